"""Drafter training: one trainer (trainer.Trainer) for every draft type, one data pipeline (data),
the target run online without grad (target.TargetRunner); model types plug in as tasks
(eagle3.Eagle3Task; MoA next). CLI: cli.add_train_parser -> `moa-serve train <type> ...`."""

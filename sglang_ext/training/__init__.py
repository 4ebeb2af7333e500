"""Drafter training: one driver (job.run, configured by config.TrainConfig) behind every `moa-serve train`
command; one trainer (trainer.Trainer) for every draft type, several heads on one target run; data
(data, shards, sources); the target run online without grad (target.TargetRunner); model types plug in
as tasks (eagle3, moa, medusa); data parallel ranks under torchrun (parallel); the target's answers from
a running server (regenerate)."""

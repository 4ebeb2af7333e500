"""Entry points: the `moa-serve` command line (cli.py) and its subcommands' argument parsing; argparse
turns into library calls here and nowhere below (serve.py, train.py, distill.py)."""

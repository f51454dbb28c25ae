"""The files and exit status a run leaves for processes that do not import torch (the launcher, Snakemake,
the report): docs/architecture.md, "Stopping and mid-epoch checkpoints" and "A finished run survives".

EXIT_STOPPED = 75 (EX_TEMPFAIL of sysexits.h: "try again later"): every rank, the launcher, the train job
and Snakemake exit so after a stop whose checkpoint was written; the same command resumes.
"""

import os

EXIT_STOPPED = 75
# Rank 0 writes it to the checkpoints folder once the stop checkpoint is written (supervise.mark_stopped).
STOPPED = "stopped.json"
# Seconds torchrun's agent waits for the ranks after a stop signal: a step, a checkpoint write
# (seconds for ResNet-50, bench/RESULTS.md) and the exit, with room for a slow disk.
STOP_GRACE_S = 300
# Written beside the checkpoints once model.pt is published: this run is complete.
FINISHED = "finished.json"
# Written beside the checkpoints when the ranks stopped on divergence (rectrain.train.lifecycle.divergence).
DIVERGED = "diverged.json"
# Set to "1" by the Snakefile's onstart hook when Snakemake forces the train job: it retrains.
FORCED_ENV = "RECTRAIN_TRAIN_FORCED"


def forced(env=None) -> bool:
    """True when Snakemake forced this train job (FORCED_ENV, set by the Snakefile's onstart)."""
    return (os.environ if env is None else env).get(FORCED_ENV) == "1"

"""What a stopped run leaves, for every process that reports it: the exit status, its marker file and
the grace time (no torch import: the Snakemake process reads these too, rectrain.snakefile.stopping).

EXIT_STOPPED = 75 (EX_TEMPFAIL of sysexits.h: "try again later") is the exit status of every rank, of
the launcher and of the train job after a stop whose checkpoint was written, and of Snakemake after a
stop it was sent: rerunning the same command resumes at the next step.
"""

EXIT_STOPPED = 75
# Rank 0 writes it to the checkpoints folder once the stop checkpoint is written (supervise.mark_stopped).
STOPPED = "stopped.json"
# Seconds torchrun's agent waits for the ranks after a stop signal: a step, a checkpoint write
# (seconds for ResNet-50, bench/RESULTS.md) and the exit, with room for a slow disk.
STOP_GRACE_S = 300

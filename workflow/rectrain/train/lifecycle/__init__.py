"""A run's lifecycle, one concern: how a run starts or resumes, checkpoints (at epoch ends, periodically,
on a stop signal), stops, is requeued under SLURM, fails with an explained line, and is republished
when a finished run is started again.  docs/architecture.md, "Follow one stop signal", walks it in order.

stop        the stop signals and the ranks' per-step agreement
status      what a stopped run leaves: exit status 75, stopped.json, the grace time (no torch: Snakemake reads it)
supervise   torchrun as the launcher's child: signals forwarded, a stop mapped to exit status 75
midepoch    mid-epoch checkpoints: state, write, stop, resume position
checkpoint  checkpoint files and the run's identity
requeue     SLURM: a stop inside the time-limit warning puts the job back in the queue
resume      resume, start over (moving the old run aside), or republish a finished run
finished    a finished run's outputs kept beside its checkpoints, and published again
failure     a failing rank's explained line (a CUDA error read as the out-of-memory it may be)
faults      the tests' fault hooks (environment variables; unset, they do nothing)
divergence  a loss that is not finite, or an fp16 loss scale that collapses: every rank stops, and no
            checkpoint with a non-finite tensor is written
"""

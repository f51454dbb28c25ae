"""A run's lifecycle, one concern: how a run starts or resumes, checkpoints (at epoch ends, periodically,
on a stop signal), stops, is requeued under SLURM, fails with an explained line, and is republished
when a finished run is started again.  docs/architecture.md, "Follow one stop signal", walks it in order.

stop        the stop signals and the ranks' per-step agreement
status      the markers and exit status of a run, torch-free (the launcher, Snakemake and the report read them)
supervise   torchrun as the launcher's child: signals forwarded, a stop mapped to exit status 75; under
            SLURM, a stop inside the time-limit warning puts the job back in the queue
midepoch    mid-epoch checkpoints: state, write, stop, resume position
checkpoint  the checkpoint files: CheckpointSaver (write, keep the last k, replaced runs, the finished record)
identity    what makes two trainings the same run (RunIdentity), recorded in every checkpoint
resume      resume, start over (moving the old run aside), or republish a finished run
failure     a failing rank's explained line (a CUDA error read as the out-of-memory it may be)
faults      the tests' fault hooks (environment variables; unset, they do nothing)
divergence  a diverged run (rectrain.train.lossband's detector) stops every rank, no bad checkpoint written
"""

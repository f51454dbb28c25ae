# train: the packed .rec/.idx -> a trained model, with per-rank telemetry for the report.
# The rule runs python -m rectrain.train, the one command that trains: it starts torchrun with one process per GPU, or train.cpu_processes CPU
# processes when there is none.  params carry the train block's output-changing keys, and the training
# code itself is an input, so editing train.* or the training modules reruns training and what follows,
# nothing before; operational keys (train.progress_s, workers, ..., pack.stage_to_local) rerun nothing.
# A killed run resumes from results/<ds>/<run>/train/checkpoints/last.pt (not a declared output, so
# Snakemake keeps it); the outputs below are written only when all epochs are done.
# One job per run ({run}: a name in RUNS, common.smk): its params, inputs and resources are the run's
# own (functions of the wildcard), so a run's edit reruns that run alone. `gpu` is the run's share of
# --resources gpu=N (its GPUs; a CPU run counts as one), and its threads that share of --cores.


rule train:
    """Train with DDP under torchrun (GPUs, or CPU processes): model.pt, weights.safetensors, telemetry, run.json; resumes from last.pt."""
    input:
        # the run's train.init_weights when it is a file, its train.resume_from: replacing one starts it again
        unpack(init_weights_input),
        # validated after every epoch, unless the dataset has no val split (index.absent_splits)
        **({"val_rec": f"{FAST}/val.rec", "val_idx": f"{FAST}/val.idx"} if HAS_VAL else {}),
        rec=f"{FAST}/train.rec",
        idx=f"{FAST}/train.idx",
        classes=f"results/{DS}/index/classes.tsv",
        # part of the resume fingerprint: a repack is another run's data
        manifest=f"results/{DS}/pack/train.manifest.json",
        code=code("train"),
        # train.model's own file and the local modules it imports (none for torchvision and timm names)
        model_code=lambda wildcards: model_sources(run_train(wildcards)["model"]),
    output:
        model=f"{RUN_DIR}/train/model.pt",
        weights=f"{RUN_DIR}/train/weights.safetensors",
        steps=f"{RUN_DIR}/train/steps.csv",
        epochs=f"{RUN_DIR}/train/epochs.csv",
        system=f"{RUN_DIR}/train/system.csv",
        run=f"{RUN_DIR}/train/run.json",
    log:
        f"logs/train/{DS}/{{run}}.log",
    benchmark:
        f"benchmarks/train/{DS}/{{run}}.tsv"
    conda:
        ENV
    threads: lambda wildcards: train_threads(workflow.resource_settings, run_train(wildcards)["devices"])
    resources:
        **train_rule_resources(config["train"]["nodes"]),
        gpus=lambda wildcards: scheduled_gpus(run_train(wildcards)["devices"]),
        gpu=lambda wildcards: run_slots(run_train(wildcards)["devices"]),
        # Under SLURM: book train.nodes nodes, one launcher per node (profiles/slurm, docs/cluster.md).
    params:
        cfg=lambda wildcards: block_params("train", run_train(wildcards)),
        out=lambda wildcards, output: os.path.dirname(output.model),
        val=lambda wildcards, input: (
            f" --val-rec {shlex.quote(input.val_rec)} --val-idx {shlex.quote(input.val_idx)}" if HAS_VAL else ""
        ),
    message:
        f"train {DS} {{wildcards.run}}: -> {{params.out}} (log: {{log}})"
    shell:
        "RECTRAIN_RUN={wildcards.run:q} python -m rectrain.train --config-json {params.cfg:q} --rec {input.rec:q} --idx {input.idx:q}{params.val}"
        " --classes {input.classes:q}"
        " --manifest {input.manifest:q}"
        " --out {params.out:q} --threads {threads} > {log:q} 2>&1"

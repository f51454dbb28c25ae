# train: the packed .rec/.idx -> a trained model, with per-rank telemetry for the report.
# The rule runs python -m rectrain.train, the one command that trains: it starts torchrun with one process per GPU, or train.cpu_processes CPU
# processes when there is none.  params carry the train block's output-changing keys, and the training
# code itself is an input, so editing train.* or the training modules reruns training and what follows,
# nothing before; operational keys (train.progress_s, workers, ..., pack.stage_to_local) rerun nothing.
# A killed run resumes from results/<ds>/train/checkpoints/last.pt (not a declared output, so
# Snakemake keeps it); the outputs below are written only when all epochs are done.


rule train:
    """Train with DDP under torchrun (GPUs, or CPU processes): model.pt, weights.safetensors, telemetry, run.json; resumes from last.pt."""
    input:
        # validated after every epoch, unless the dataset has no val split (index.absent_splits)
        **({"val_rec": f"{FAST}/val.rec", "val_idx": f"{FAST}/val.idx"} if HAS_VAL else {}),
        **init_weights_input(config["train"]["init_weights"]),
        rec=f"{FAST}/train.rec",
        idx=f"{FAST}/train.idx",
        classes=f"results/{DS}/index/classes.tsv",
        # part of the resume fingerprint: a repack is another run's data
        manifest=f"results/{DS}/pack/train.manifest.json",
        code=code("train"),
        # train.model's own file and the local modules it imports (none for torchvision and timm names)
        model_code=model_sources(config["train"]["model"]),
        # train.init_weights when it is a file: replacing it starts the run again
    output:
        model=f"results/{DS}/train/model.pt",
        weights=f"results/{DS}/train/weights.safetensors",
        steps=f"results/{DS}/train/steps.csv",
        epochs=f"results/{DS}/train/epochs.csv",
        system=f"results/{DS}/train/system.csv",
        run=f"results/{DS}/train/run.json",
    log:
        f"logs/train/{DS}.log",
    benchmark:
        f"benchmarks/train/{DS}.tsv"
    conda:
        ENV
    threads: all_cores
    resources:
        **train_rule_resources(config["train"]["nodes"]),
        gpus=scheduled_gpus(config["train"]["devices"]),
        # Under SLURM: book train.nodes nodes, one launcher per node (profiles/slurm, docs/cluster.md).
    params:
        cfg=cfg_json("train"),
        out=lambda wildcards, output: os.path.dirname(output.model),
        val=lambda wildcards, input: (
            f" --val-rec {shlex.quote(input.val_rec)} --val-idx {shlex.quote(input.val_idx)}" if HAS_VAL else ""
        ),
    message:
        f"train {DS}: -> {{params.out}} (log: {{log}})"
    shell:
        "python -m rectrain.train --config-json {params.cfg:q} --rec {input.rec:q} --idx {input.idx:q}{params.val}"
        " --classes {input.classes:q}"
        " --manifest {input.manifest:q}"
        " --out {params.out:q} --threads {threads} > {log:q} 2>&1"

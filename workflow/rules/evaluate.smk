# evaluate: the final checkpoint on the val .rec -> top-1/top-5, loss and per-class accuracy.
# Model, classes and image size come from the checkpoint, so params carry only the evaluate block
# (editing train.* reruns evaluate through the new checkpoint, not through params). With several
# training GPUs the job runs one process per GPU under torchrun; see workflow/rectrain/evaluate.py.


rule evaluate:
    """Evaluate model.pt on the val split: metrics.json and per_class.csv."""
    input:
        unpack(val_pair),
        checkpoint=f"results/{DS}/train/model.pt",
        classes=f"results/{DS}/index/classes.tsv",
        code=code("evaluate"),
    output:
        metrics=report(f"results/{DS}/eval/metrics.json", caption="../report/metrics.rst", category="Evaluation"),
        per_class=report(f"results/{DS}/eval/per_class.csv", caption="../report/per_class.rst", category="Evaluation"),
    log:
        f"logs/evaluate/{DS}.log",
    benchmark:
        f"benchmarks/evaluate/{DS}.tsv"
    conda:
        ENV
    threads: all_cores
    resources:
        # the same GPUs as training (the checkpoint's train block decides the processes at run time)
        gpus=scheduled_gpus(config["train"]["devices"]),
    params:
        cfg=cfg_json("evaluate"),
        out=lambda wildcards, output: os.path.dirname(output.metrics),
    message:
        f"evaluate {DS} val: {{input.checkpoint}} -> {{params.out}} (log: {{log}})"
    shell:
        "python -m rectrain.evaluate --config-json {params.cfg:q} --checkpoint {input.checkpoint:q}"
        " --rec {input.rec:q} --idx {input.idx:q} --classes {input.classes:q} --out {params.out:q}"
        " > {log:q} 2>&1"

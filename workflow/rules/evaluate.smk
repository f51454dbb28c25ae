# evaluate: the published weights on the val .rec -> top-1/top-5, loss and per-class accuracy, and
# weights.json beside the weights (their description and the top-1 measured here on that very file).
# Model, classes and image size come from the checkpoint, so params carry only the evaluate block
# (editing train.* reruns evaluate through the new checkpoint, not through params). With several
# training GPUs the job runs one process per GPU under torchrun; see workflow/rectrain/evaluate.py.


rule evaluate:
    """Evaluate weights.safetensors on the val split: metrics.json, per_class.csv, weights.json."""
    input:
        unpack(val_pair),
        checkpoint=f"{RUN_DIR}/train/model.pt",
        weights=f"{RUN_DIR}/train/weights.safetensors",
        classes=f"results/{DS}/index/classes.tsv",
        code=code("evaluate"),
    output:
        metrics=report(f"{RUN_DIR}/eval/metrics.json", caption="../report/metrics.rst", category="Evaluation"),
        per_class=report(f"{RUN_DIR}/eval/per_class.csv", caption="../report/per_class.rst", category="Evaluation"),
        weights_json=f"{RUN_DIR}/train/weights.json",
    log:
        f"logs/evaluate/{DS}/{{run}}.log",
    benchmark:
        f"benchmarks/evaluate/{DS}/{{run}}.tsv"
    conda:
        ENV
    threads: all_cores
    resources:
        # the same GPUs as training (the checkpoint's train block decides the processes at run time)
        gpus=lambda wildcards: scheduled_gpus(run_train(wildcards)["devices"]),
    params:
        cfg=lambda wildcards: block_params("evaluate", RUNS[wildcards.run]["evaluate"]),
        out=lambda wildcards, output: os.path.dirname(output.metrics),
    message:
        f"evaluate {DS} {{wildcards.run}} val: {{input.weights}} -> {{params.out}} (log: {{log}})"
    shell:
        "RECTRAIN_RUN={wildcards.run:q} python -m rectrain.evaluate --config-json {params.cfg:q} --checkpoint {input.checkpoint:q}"
        " --weights {input.weights:q} --weights-json {output.weights_json:q}"
        " --rec {input.rec:q} --idx {input.idx:q} --classes {input.classes:q} --out {params.out:q}"
        " > {log:q} 2>&1"

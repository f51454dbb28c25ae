# check: known weights (check.weights) through this dataset's val .rec with the evaluate stage's
# preprocessing, before a long run - no training needed; see workflow/rectrain/check.py and docs/check.md.
# Runs only when asked for (`snakemake --cores 8 results/<ds>/check/report.json`); the report shows it once
# it has run (rules/report.smk). params carry the check block alone, so editing it reruns only the check.


rule check:
    """Evaluate check.weights on the val split and say what the top-1 against the published one means."""
    input:
        unpack(val_pair),
        **check_weights_input(config["check"]["weights"]),
        classes=f"results/{DS}/index/classes.tsv",
        # the val layout, for the likely cause of misaligned labels (none for your own .rec)
        val_index=[] if BYO else f"results/{DS}/index/val.tsv",
        code=code("check"),
    output:
        report=f"results/{DS}/check/report.json",
    log:
        f"logs/check/{DS}.log",
    benchmark:
        f"benchmarks/check/{DS}.tsv"
    conda:
        ENV
    threads: all_cores
    resources:
        gpus=min(1, scheduled_gpus(config["train"]["devices"])),
    params:
        cfg=cfg_json("check"),
        val_index=lambda wildcards, input: f" --val-index {shlex.quote(input.val_index)}" if input.val_index else "",
    message:
        f"check {DS} val with {config['check']['weights']}: -> {{output.report}} (log: {{log}})"
    shell:
        "python -m rectrain.check --config-json {params.cfg:q} --rec {input.rec:q} --idx {input.idx:q}"
        " --classes {input.classes:q}{params.val_index} --out {output.report:q} > {log:q} 2>&1"
        " && tail -n 1 {log:q}"

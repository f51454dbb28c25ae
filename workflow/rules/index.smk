# index_raw: which file (or tar member, read in place) is which class; labels = sorted wnids like
# im2rec --recursive. Writes train/val/classes/unclassified TSVs; see workflow/rectrain/data/index.py.
# The first real stage starts with rectrain.driver_check: a GPU machine whose driver is too old for the
# torch build stops here, not after hours of packing. That check is no code input of this rule: editing
# it must not re-index (and so repack) a dataset; it changes no output.


rule index_raw:
    """Index the raw dataset: train/val/classes TSVs, and every file not taken with why."""
    input:
        # A real raw root is checked by config validation; its millions of files are not tracked.
        marker=[f"{DEMO_ROOT}/.done"] if config["raw"] is None else [],
        code=code("index_raw"),
        classes=index_classes_file(config["index"]["classes"]),
    output:
        expand("results/{ds}/index/{name}.tsv", ds=DS, name=["train", "val", "classes", "unclassified"]),
    log:
        f"logs/index_raw/{DS}.log",
    benchmark:
        f"benchmarks/index_raw/{DS}.tsv"
    conda:
        ENV
    params:
        cfg=cfg_json("index"),
        # The demo root comes from the input marker; a real raw root is the configured path.
        raw=lambda wildcards, input: os.path.dirname(input.marker[0]) if input.marker else RAW_ROOT,
        out=lambda wildcards, output: os.path.dirname(output[0]),
    message:
        f"index_raw {DS}: indexing {{params.raw}} (log: {{log}})"
    shell:
        "python -m rectrain.driver_check > {log:q} 2>&1 && "
        "python -m rectrain.data.index --config-json {params.cfg:q} --raw {params.raw:q} --out {params.out:q}"
        " >> {log:q} 2>&1"

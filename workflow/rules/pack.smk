# Pack: index + raw images -> MXNet RecordIO (.rec/.idx) per split on fast storage.
# The job checks the target first (room, rotational disk), writes *.partial, reads every record
# back (rectrain.data.verify) and only then renames the pair, so the outputs exist only when verified.


rule pack:
    """Pack one split into a verified MXNet RecordIO .rec/.idx on fast storage, with its manifest."""
    input:
        tsv=f"results/{DS}/index/{{split}}.tsv",
        classes=f"results/{DS}/index/classes.tsv",
        code=code("pack"),
    output:
        rec=f"{FAST}/{{split}}.rec",
        idx=f"{FAST}/{{split}}.idx",
        manifest=report(
            f"results/{DS}/pack/{{split}}.manifest.json",
            caption="../report/manifest.rst",
            category="Pack",
            labels={"split": "{split}"},
        ),
    log:
        f"logs/pack/{DS}_{{split}}.log",
    benchmark:
        f"benchmarks/pack/{DS}_{{split}}.tsv"
    wildcard_constraints:
        split="|".join(SPLITS),
    conda:
        ENV
    threads: config["pack"]["threads"]
    params:
        # The pack block's output-changing keys; threads, read order, progress interval and staging are
        # operational (x-rerun: false) and reach the job through the environment, so editing them never
        # repacks 140 GB.
        cfg=cfg_json("pack"),
        index=lambda wildcards, input: os.path.dirname(input.tsv),
        raw=RAW_ROOT,
    message:
        f"pack {DS} {{wildcards.split}}: {{input.tsv}} -> {{output.rec}} (log: {{log}})"
    shell:
        "python -m rectrain.data.pack --config-json {params.cfg:q} --index {params.index:q} --raw {params.raw:q}"
        " --split {wildcards.split} --rec {output.rec:q} --idx {output.idx:q}"
        " --manifest {output.manifest:q} --threads {threads} > {log:q} 2>&1"

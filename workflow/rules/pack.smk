# Pack: index + raw images -> MXNet RecordIO (.rec/.idx) per split on fast storage.
# The job checks the target first (room, rotational disk), writes *.partial, reads every record
# back (rectrain.data.verify) and only then renames the pair, so the outputs exist only when verified.


rule pack:
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
        # Only the keys that change the bytes written or whether they are published: editing
        # pack.threads or the staging settings must not repack 140 GB.
        cfg=json.dumps(
            {
                k: config["pack"][k]
                for k in ("resize", "quality", "shuffle_seed", "max_skipped_share", "check_scan_data")
            },
            sort_keys=True,
        ),
        # How the pair is made, not its bytes (the .rec is the same in either read order): outside
        # cfg and given as functions, whose values Snakemake does not compare, so editing them never repacks.
        read_order=lambda wildcards: config["pack"]["read_order"],
        progress_s=lambda wildcards: config["pack"]["progress_s"],
        index=lambda wildcards, input: os.path.dirname(input.tsv),
        raw=RAW_ROOT,
    shell:
        "python -m rectrain.data.pack --config-json {params.cfg:q} --index {params.index:q} --raw {params.raw:q}"
        " --split {wildcards.split} --rec {output.rec:q} --idx {output.idx:q}"
        " --manifest {output.manifest:q} --threads {threads} --read-order {params.read_order}"
        " --progress-s {params.progress_s} > {log:q} 2>&1"

# check_recordio (bring your own .rec): existing .rec/.idx pairs (recordio.train, recordio.val) take the
# place of index_raw and pack. The job reads every record (framing, the .idx against the .rec, labels,
# every image through the pack's check, the record order) and writes what the pack and the index would:
# the pair in fast storage (a symlink to the user's file, or a shuffled byte-for-byte copy when
# recordio.order: shuffle meets a class-ordered file), the manifests and classes.tsv. The user's files are
# inputs, so replacing one reruns the check and everything after it; they are never written.


def byo_inputs(wildcards):
    """The configured .rec/.idx/.lst files and the class list: the check reruns when one changes."""
    byo = config["recordio"]
    files = {f"{split}_{kind}": path for split in SPLITS for kind, path in byo[split].items()}
    return {**files, **({"classes": byo["classes"]} if byo["classes"] else {})}


rule check_recordio:
    """Check a .rec/.idx pair of your own record by record (instead of index_raw and pack)."""
    input:
        unpack(byo_inputs),
        code=code("check_recordio"),
    output:
        pairs=expand(f"{FAST}/{{split}}.{{ext}}", split=SPLITS, ext=["rec", "idx"]),
        manifests=expand(f"results/{DS}/pack/{{split}}.manifest.json", split=SPLITS),
        classes=f"results/{DS}/index/classes.tsv",
    log:
        f"logs/check_recordio/{DS}.log",
    benchmark:
        f"benchmarks/check_recordio/{DS}.tsv"
    conda:
        ENV
    threads: config["recordio"]["threads"]
    params:
        cfg=cfg_json("recordio"),
        pack=lambda wildcards, output: os.path.dirname(output.manifests[0]),
        index=lambda wildcards, output: os.path.dirname(output.classes),
    message:
        f"check_recordio {DS}: reading every record of the configured .rec/.idx (log: {{log}})"
    shell:
        "python -m rectrain.data.byo_recordio --config-json {params.cfg:q} --fast {FAST:q}"
        " --pack-dir {params.pack:q} --index-dir {params.index:q} --threads {threads} > {log:q} 2>&1"

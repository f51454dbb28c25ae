# demo_data: the embedded demo ImageNet (used when config raw is null). Every layout a real user has
# (folders, flat val + Kaggle CSV / devkit, the official tars) plus planted bad files; see
# workflow/rectrain/data/demo.py. The marker .done is written last, so a killed run is redone.


rule demo_data:
    """Generate the demo's ImageNet-shaped raw dataset (folders, tars, planted defects) when raw is null."""
    input:
        code=code("demo_data"),
    output:
        f"{DEMO_ROOT}/.done",
    log:
        f"logs/demo_data/{DS}.log",
    benchmark:
        f"benchmarks/demo_data/{DS}.tsv"
    conda:
        ENV
    threads: all_cores
    params:
        cfg=cfg_json("demo"),
        out=lambda wildcards, output: os.path.dirname(output[0]),
    message:
        f"demo_data {DS}: generating the demo images in {{params.out}} (log: {{log}})"
    shell:
        "python -m rectrain.data.demo --config-json {params.cfg:q} --out {params.out:q}"
        " --threads {threads} > {log:q} 2>&1"

# report: results/<dataset>/report.html, one self-contained page (plots embedded) on how fast, how good and
# what held the run back, with a plain-words diagnosis; see workflow/rectrain/report/.
# Inputs are every stage's outputs plus their Snakemake benchmark files (Snakemake treats a rule's
# benchmark file as one of its outputs, so they are valid inputs here). The report's own benchmark
# cannot be among them.


rule report:
    """Write results/report.html: speed, accuracy, plain-words diagnosis, from every stage's outputs."""
    input:
        train=expand(
            f"{RUN_DIR}/train/{{name}}", name=["steps.csv", "epochs.csv", "system.csv", "run.json"], allow_missing=True
        ),
        eval=rules.evaluate.output if HAS_VAL else [],
        manifests=expand(f"results/{DS}/pack/{{split}}.manifest.json", split=SPLITS),
        classes=f"results/{DS}/index/classes.tsv",
        # the check's report once it has run (the check runs only when asked for), so running it reruns this
        check=check_report_input,
        code=code("report"),
        # every covered stage's benchmark file, in pipeline order, taken from the rules themselves
        benchmarks=[
            *(
                [str(rules.check_recordio.benchmark)]
                if BYO
                else [
                    *([str(rules.demo_data.benchmark)] if config["raw"] is None else []),
                    str(rules.index_raw.benchmark),
                    *expand(str(rules.pack.benchmark), split=SPLITS),
                ]
            ),
            str(rules.train.benchmark),
            *([str(rules.evaluate.benchmark)] if HAS_VAL else []),
        ],
    output:
        report(f"{RUN_DIR}/report.html", caption="../report/report_html.rst", category="Report"),
    log:
        f"logs/report/{DS}/{{run}}.log",
    benchmark:
        f"benchmarks/report/{DS}/{{run}}.tsv"
    conda:
        ENV
    params:
        # Every block's output-changing keys: the report shows the config under Provenance and takes its
        # thresholds from config["report"]; a real change anywhere reruns only this cheap job.
        cfg=lambda wildcards: report_params(RUNS[wildcards.run]),
        train=lambda wildcards, input: os.path.dirname(input.train[0]),
        # no val split: no evaluate stage, and the report says so
        eval=lambda wildcards, input: f" --eval-dir {shlex.quote(os.path.dirname(input.eval[0]))}" if input.eval else "",
        pack=lambda wildcards, input: os.path.dirname(input.manifests[0]),
        index=lambda wildcards, input: os.path.dirname(input.classes),
        check=lambda wildcards, input: f" --check {shlex.quote(input.check[0])}" if input.check else "",
    message:
        f"report {DS} {{wildcards.run}}: -> {{output}} (log: {{log}})"
    shell:
        "RECTRAIN_RUN={wildcards.run:q} python -m rectrain.report --config-json {params.cfg:q} --train-dir {params.train:q}{params.eval}"
        " --pack-dir {params.pack:q} --index-dir {params.index:q}"
        " --benchmarks {input.benchmarks:q}{params.check} --out {output:q} > {log:q} 2>&1"


# results/report.html: a copy of the configured run's report (the config's `run`, main by default), so
# `snakemake results/report.html` works for every config. Each run's own report stays in
# results/<dataset>/<run>/ and is the default target (rule all), so after running dataset B, `snakemake -n` with dataset A's config still has
# nothing to do; asking for results/report.html with A's config copies A's report back (a copy, not a
# link: it opens offline and survives moving the folder).
rule current_report:
    """Copy the configured run's report to results/report.html (the mission's path)."""
    input:
        expand(rules.report.output[0], run=RUN),
    output:
        "results/report.html",
    log:
        f"logs/report/{DS}_current.log",
    localrule: True
    conda:
        ENV
    message:
        f"current_report {DS} {RUN}: {{input}} copied to {{output}}"
    shell:
        "cp {input:q} {output:q} > {log:q} 2>&1"


# results/<dataset>/compare.html: every run of the config (a sweep's, or the one) side by side - the
# run table with params and FLOPs, the curves overlaid, accuracy against throughput, and the config
# differences key by key (rectrain.report.compare). Runs still training are shown from their live
# telemetry; this rule needs every run's report, so it is built once all are done.
rule compare:
    """Write results/<dataset>/compare.html: every run's table row, curves and config differences."""
    input:
        reports=expand(rules.report.output[0], run=list(RUNS)),
        code=code("compare"),
    output:
        report(f"results/{DS}/compare.html", caption="../report/compare_html.rst", category="Report"),
    log:
        f"logs/report/{DS}_compare.log",
    conda:
        ENV
    params:
        # every run's whole config: the page shows their differences key by key
        cfg=lambda wildcards: json.dumps(
            {name: json.loads(report_params(given)) for name, given in RUNS.items()}, sort_keys=True
        ),
        runs=lambda wildcards, input: " ".join(shlex.quote(os.path.dirname(r)) for r in input.reports),
    message:
        f"compare {DS}: {len(RUNS)} run(s) -> {{output}} (log: {{log}})"
    shell:
        "python -m rectrain.report.compare --configs-json {params.cfg:q} --runs {params.runs}"
        " --out {output:q} > {log:q} 2>&1"

# report: results/<dataset>/report.html, one self-contained page (plots embedded) on how fast, how good and
# what held the run back, with a plain-words diagnosis; see workflow/rectrain/report/.
# Inputs are every stage's outputs plus their Snakemake benchmark files (Snakemake treats a rule's
# benchmark file as one of its outputs, so they are valid inputs here). The report's own benchmark
# cannot be among them.


rule report:
    """Write results/report.html: speed, accuracy, plain-words diagnosis, from every stage's outputs."""
    input:
        train=expand(f"results/{DS}/train/{{name}}", name=["steps.csv", "epochs.csv", "system.csv", "run.json"]),
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
        report(f"results/{DS}/report.html", caption="../report/report_html.rst", category="Report"),
    log:
        f"logs/report/{DS}.log",
    benchmark:
        f"benchmarks/report/{DS}.tsv"
    conda:
        ENV
    params:
        # Every block's output-changing keys: the report shows the config under Provenance and takes its
        # thresholds from config["report"]; a real change anywhere reruns only this cheap job.
        cfg=report_params(config),
        train=lambda wildcards, input: os.path.dirname(input.train[0]),
        # no val split: no evaluate stage, and the report says so
        eval=lambda wildcards, input: f" --eval-dir {shlex.quote(os.path.dirname(input.eval[0]))}" if input.eval else "",
        pack=lambda wildcards, input: os.path.dirname(input.manifests[0]),
        index=lambda wildcards, input: os.path.dirname(input.classes),
        check=lambda wildcards, input: f" --check {shlex.quote(input.check[0])}" if input.check else "",
    message:
        f"report {DS}: -> {{output}} (log: {{log}})"
    shell:
        "python -m rectrain.report --config-json {params.cfg:q} --train-dir {params.train:q}{params.eval}"
        " --pack-dir {params.pack:q} --index-dir {params.index:q}"
        " --benchmarks {input.benchmarks:q}{params.check} --out {output:q} > {log:q} 2>&1"


# results/report.html: a copy of the configured dataset's report, so `snakemake results/report.html`
# works for every config. Each dataset's own report stays in results/<dataset>/ and is the default
# target (rule all), so after running dataset B, `snakemake -n` with dataset A's config still has
# nothing to do; asking for results/report.html with A's config copies A's report back (a copy, not a
# link: it opens offline and survives moving the folder).
rule current_report:
    """Copy the configured dataset's report to results/report.html (the mission's path)."""
    input:
        rules.report.output,
    output:
        "results/report.html",
    log:
        f"logs/report/{DS}_current.log",
    localrule: True
    conda:
        ENV
    message:
        f"current_report {DS}: {{input}} copied to {{output}}"
    shell:
        "cp {input:q} {output:q} > {log:q} 2>&1"

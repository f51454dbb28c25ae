"""Code the workflow runs while Snakemake parses it (workflow/rules/*.smk) and in the profiles'
resource expressions: config checks, the jobs' environment, the rules' params, what rules book; and
what the Snakemake process does around its jobs from its hooks (hooks: the console relay, the stop).

No stage imports this package, so it is in no stage's code input: editing it reruns nothing.
"""

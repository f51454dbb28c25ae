"""Code the workflow runs while Snakemake parses it (workflow/rules/*.smk) and in the profiles'
resource expressions: config checks, the jobs' environment, the rules' params, what rules book.

No stage imports this package, so it is in no stage's code input: editing it reruns nothing.
"""

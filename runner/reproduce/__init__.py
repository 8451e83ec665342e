"""`python -m runner.reproduce`: the seed papers' headline comparisons at this machine's scale.

One module per paper (`sc17`, `grid`, `parallax`), each with `collect` (run or plan, return
JSON-able results), `render` (a markdown page and its PNGs from those results) and `headline`
(its rows of the index's table); `runs` holds what they share: launching runs through the
project's own command line and reading their run directories, and the markdown helpers.
"""

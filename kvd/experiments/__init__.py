"""``kvd experiment``: the seed's six open questions, answered on this machine.

Each experiment prints a table, writes its figures as JSON and a PNG plot,
and states its answer in one line; ``report`` runs them all into one
Markdown report (docs/capacity/README.md is this machine's).
"""

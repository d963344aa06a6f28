"""The tree-vs-chain study: sweeps, tables, plots.

``grid`` (which configurations per budget D), ``metrics`` (one cell's numbers),
``study`` (running: ``run_study(StudyConfig) -> StudyResult``), ``analysis`` (tree vs
chain at matched D), ``report`` (report.md and console tables), ``plots`` (PNG figures),
``cli`` (``branchspec bench``).
"""

from branchspec.bench.study import StudyConfig, StudyResult, run_study

__all__ = ["StudyConfig", "StudyResult", "run_study"]

"""Old command line: ``python experiments/report.py SWEEP_DIR`` is ``lightning-par-report SWEEP_DIR``."""
from lightning_par.tools.report import main
raise SystemExit(main())

"""Layer 0, the base: leaf helpers every layer may use -- dtypes, the device peak table, optimizer building,
Lightning's logging cadence, job bookkeeping (error.json, run directories, the exit watcher, the fork
server a CPU job's ranks start from), the token file's
layout and byte formatting. Nothing here imports another lightning_par layer."""

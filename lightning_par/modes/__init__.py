"""The app's modes beside training: ``mode=estimate`` and its command line (``costs/estimate.py``),
``mode=find_batch_size`` (``batch_size.py``) and the advisor's command line (``advise.py``). App
code: they read config and print; the cost models they ask (``lightning_par/costs``, ``costs/estimate.py``,
``costs/advisor.py``) take plain arguments."""

"""The app's modes beside training: ``mode=estimate`` and its command line (``estimate.py``),
``mode=find_batch_size`` (``batch_size.py``) and the advisor's command line (``advise.py``). App
code: they read config and print; the cost models they ask (``lightning_par/costs``, ``estimate.py``,
``advisor.py``) take plain arguments."""

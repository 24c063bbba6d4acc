"""``python run.py ...`` from a checkout is the ``lightning-par`` command (lightning_par/cli.py):

    python run.py strategy=ddp trainer.devices=2
    python run.py -m strategy=single,ddp trainer.devices=2
    torchrun --nproc-per-node=2 --max-restarts=3 run.py strategy=ddp callbacks=checkpoint ckpt_path=auto
"""

from lightning_par.cli import main

if __name__ == "__main__":
    main()

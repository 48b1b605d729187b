"""What the resume workers (`resume_kill_worker.py`, `resume_steps_worker.py`, `resume_sharded_worker.py`) share: a
torchrun process's start, the digits loaders, each step's lr, and a SIGKILL at a given micro-batch."""
import os, signal
from datetime import timedelta
import torch, torch.distributed as dist
from fastai.basics import *
import ddp_worker as W

def start()->tuple[int,int]:
    "One thread, fastai's distributed set-up on the CPU, the gloo group: (rank, torchrun's attempt)"
    torch.set_num_threads(1)
    rank,attempt = int(os.environ.get('RANK', 0)),int(os.environ.get('TORCHELASTIC_RESTART_COUNT', 0))
    W.fastai_distributed()
    dist.init_process_group('gloo', timeout=timedelta(seconds=W.PG_TIMEOUT))
    return rank,attempt

def digits_dls()->DataLoaders:
    "Digits, 1,000 training samples and 256 for validation, fastai's default loaders (micro-batches of 8), seeded"
    from fastxtend_accum.test_utils import digits_data, Samples
    x,y = digits_data()
    trn,val = Samples(zip(x[:1000], y[:1000])),Samples(zip(x[-256:], y[-256:]))
    set_seed(0)
    return DataLoaders.from_dsets(trn, val, bs=8, device='cpu', num_workers=0)

class Lrs(Callback):
    "Each optimizer step's (epoch, lr)"
    order = 7
    def before_fit(self): self.lrs = []
    def before_step(self): self.lrs.append((self.epoch, float(self.opt.hypers[-1]['lr'])))

class Kill(Callback):
    "SIGKILL at micro-batch `at_iter` of epoch `at_epoch` (no exception, no cleanup)"
    def __init__(self, at_epoch:int, at_iter:int): self.at_epoch,self.at_iter = at_epoch,at_iter
    def before_batch(self):
        if self.training and (self.epoch, self.iter) == (self.at_epoch, self.at_iter):
            os.kill(os.getpid(), signal.SIGKILL)

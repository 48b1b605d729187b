"""One process of the same training script with `global_bs=True`, run on one process (`python tests/global_bs_worker.py
OUT 1 CASES`) and on two (`python -m torch.distributed.run --nproc_per_node=2 tests/global_bs_worker.py OUT 2 CASES`,
gloo, CPU), started by `test_global_bs.py`.

Every case trains a float64 MLP on digits with `fit_one_cycle` under `learn.distrib_ctx(cpu=True)` (which does nothing
on one process, as in a user's script run with `python`), and writes to `OUT/<case>-w<world>-rank<r>.pt` what the test
compares between one and two processes: the optimizer steps of each epoch, the samples each step held over all processes
(`held_bs`, what the Recorder, W&B and TensorBoard log), the lr of each step, the parameters, and the one-time messages.

Cases whose name ends in `_dealt` train on an unshuffled loader: on two processes, the library deals its order window by
window (`dealing.WindowDealtDL`), so each window holds the samples one process's window holds, and the weights must be
the same (before the dealing, one process reordered its samples to match fastai's contiguous halves)."""
import os, sys, warnings
import torch, torch.nn as nn, torch.distributed as dist
from fastai.basics import *
from fastai.data.load import DataLoader as FastaiDataLoader

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import ddp_worker as W

N_EPOCH,LR = 2,0.1
N_DEFAULT,N_DEALT,N_VALID = 1024,544,256 # 544 = 34 micro-batches of 16: an epoch's last window is short

def callbacks(case:str)->Callback:
    "The accumulation callback of each case: one line, the same on any number of processes"
    from fastxtend_accum.callback.gradaccum import GradientAccumulation
    from fastxtend_accum.callback.schedule import GradientAccumulationSchedule
    from fastai.callback.schedule import SchedCos
    base = case.removesuffix('_dealt')
    if base in ('ga', 'unwrapped'): return GradientAccumulation(128, global_bs=True)
    if base == 'ga_off': return GradientAccumulation(64) # accum_bs per process: 128 samples per step on two processes
    if base == 'indivisible': return GradientAccumulation(100, global_bs=True)
    # the size jumps from 256 to 64 at the second epoch (start = finish = epoch 1)
    if base == 'gas': return GradientAccumulationSchedule(256, 64, start=1, finish=1, global_bs=True)
    if base == 'gas_cos': return GradientAccumulationSchedule(256, 64, finish=0.75, schedule=SchedCos, global_bs=True)
    if base == 'gas_indivisible': return GradientAccumulationSchedule(100, 200, finish=0.75, global_bs=True)
    if base == 'gas_below': return GradientAccumulationSchedule(16, 64, global_bs=True)
    raise ValueError(case)

def micro_bs(case:str, world:int)->int:
    """16 on every process; 32 on one process for the cases whose sizes are rounded to what the processes share (a
    multiple of 2 x 16): the same global micro-batch, so the same windows"""
    return 32//world if case.removesuffix('_dealt') in ('gas_cos', 'indivisible', 'gas_indivisible') else 16

class Dealt(FastaiDataLoader):
    "An unshuffled fastai loader whose epoch order is `order` once set"
    order = None
    def get_idxs(self): return list(self.order) if self.order is not None else super().get_idxs()

class Probe(Callback):
    "What the test reads: world sizes at before_fit and before_train, and each optimizer step's epoch, samples and lr"
    order = 7

    def __init__(self):
        self.steps, self.ws_fit, self.ws_train, self.wrapped_at_fit = [], None, [], None  # a fit may stop before ours

    def before_fit(self):
        from fastxtend_accum.patches import accum_callback
        self.cb = accum_callback(self.learn)
        self.steps,self.ws_fit,self.ws_train = [],self.cb.windows.world_size,[]
        self.wrapped_at_fit = type(self.model).__name__  # fastai's DistributedTrainer wraps it after this

    def before_train(self):
        self.ws_train.append((self.cb.windows.world_size, self.cb.windows.sync.world_size, type(self.model).__name__))

    def after_batch(self):
        if self.training and self.cb.window_closed:
            self.steps.append((self.epoch, self.cb.held_bs, float(self.opt.hypers[-1]['lr'])))

class EpochsFor(Callback):
    """What `lr_find` asks the accumulation callback in its `before_fit`, after fastai's `DistributedTrainer` wrapped
    the model and loaders: the epochs that 10 optimizer steps need (`epochs_for`)"""
    order = 12 # after DistributedTrainer (11), where LRFinder (50) asks
    def __init__(self): self.n_epoch_for_10 = None
    def before_fit(self):
        from fastxtend_accum.patches import accum_callback
        self.n_epoch_for_10 = accum_callback(self.learn).epochs_for(10)

def learner(case:str, world:int, rank:int, cbs:list)->Learner:
    "The script's Learner: fastai's default loaders (shuffled, drop_last), or an unshuffled one for the `_dealt` cases"
    from fastxtend_accum.test_utils import digits_data, digits_mlp, Float64SmoothLoss, Samples
    x,y = digits_data()
    n = N_DEALT if case.endswith('_dealt') else N_DEFAULT
    trn,val = Samples(zip(x[:n], y[:n])),Samples(zip(x[-N_VALID:], y[-N_VALID:]))
    bs = micro_bs(case, world)
    if case == 'unwrapped': # per-process loaders and no distributed engine: each process trains alone
        trn = Samples(trn[rank*n//2:(rank+1)*n//2])
    if case.endswith('_dealt'):
        dls = DataLoaders(Dealt(trn, bs=bs, device='cpu'), FastaiDataLoader(val, bs=64, device='cpu'), device='cpu')
    else:
        set_seed(0)
        dls = DataLoaders.from_dsets(trn, val, bs=bs, device='cpu')
    return Learner(dls, digits_mlp(seed=0), loss_func=nn.CrossEntropyLoss(), opt_func=SGD, lr=LR,
                   cbs=[Float64SmoothLoss()] + cbs)

def loggers(out:str, tag:str):
    "fastai's W&B (offline) and TensorBoard callbacks, on rank 0"
    import wandb
    from fastai.callback.wandb import WandbCallback
    from fastai.callback.tensorboard import TensorBoardCallback
    run = wandb.init(project='fastxtend-accum-tests', dir=os.path.join(out, f'wandb-{tag}'), mode='offline')
    return run,[WandbCallback(log_preds=False, log_model=False),
                TensorBoardCallback(os.path.join(out, f'tb-{tag}'), trace_model=False, log_preds=False)]

def pg_kwargs()->dict:
    """`distrib_ctx`'s arguments: none when the script set up the process group; else the process-group timeout for the
    group that fastai's `DistributedTrainer` (its `Accelerator`) sets up, before the fit, as in a user's script"""
    if dist.is_initialized() or int(os.environ.get('WORLD_SIZE', 1)) == 1: return {}
    from datetime import timedelta
    from accelerate.utils import InitProcessGroupKwargs
    return dict(kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=W.PG_TIMEOUT))])

def run_case(case:str, out:str, world:int, rank:int):
    cb,probe,ef = callbacks(case),Probe(),EpochsFor()
    learn = learner(case, world, rank, [cb, probe, ef])
    log = case in ('gas', 'ga_off') and rank == 0
    run,extra = loggers(out, f'{case}-w{world}') if log else (None, [])
    res = dict(error=None)
    with warnings.catch_warnings(record=True) as w, learn.no_logging(), learn.no_bar():
        warnings.simplefilter('always')
        try:
            if case == 'unwrapped': learn.fit_one_cycle(N_EPOCH, LR, cbs=extra) # no distrib_ctx: no DDP
            else:
                with learn.distrib_ctx(cpu=True, **pg_kwargs()): learn.fit_one_cycle(N_EPOCH, LR, cbs=extra)
        except ValueError as e: res['error'] = str(e)
        finally:
            if run is not None: run.finish()
    res.update(
        messages=[str(o.message) for o in w if 'divide' in str(o.message) or 'multiple' in str(o.message)],
        epochs_for_10=ef.n_epoch_for_10,
        ws_fit=probe.ws_fit,
        wrapped_at_fit=probe.wrapped_at_fit,
        ws_train=probe.ws_train,
        steps=probe.steps,
        lrs=[float(o) for o in vars(learn.recorder).get('lrs', [])],
        losses=[float(o) for o in vars(learn.recorder).get('losses', [])],
        hps_accum_bs=vars(learn.recorder).get('hps', {}).get('accum_bs'),
        params=[p.detach().clone() for p in learn.model.parameters()],
        wandb_dir=None if run is None else run.settings.sync_dir,
    )
    torch.save(res, os.path.join(out, f'{case}-w{world}-rank{rank}.pt'))

def main(out:str, world:int, cases:list[str]):
    torch.set_num_threads(1)
    rank = int(os.environ.get('RANK', 0))
    W.fastai_distributed() # `Learner.distrib_ctx`; DistributedDL broadcasting the sample order on the CPU
    if world > 1 and not os.environ.get('FXA_NO_INIT'): # FXA_NO_INIT: the script leaves it to `distrib_ctx`
        from datetime import timedelta
        dist.init_process_group('gloo', timeout=timedelta(seconds=W.PG_TIMEOUT))
        assert dist.get_world_size() == world
    for case in cases: run_case(case, out, world, rank)
    # gloo torn down before exit: else its threads can abort it
    if world > 1: dist.barrier(); dist.destroy_process_group()

if __name__ == '__main__':
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3].split(','))
    W.exit_worker() # no teardown for gloo's threads to abort

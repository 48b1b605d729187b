"""Train with the real `WandbCallback` (offline) and `TensorBoardCallback`, read back the files they write, and check
rows, steps and values against the Recorder, with and without `log_accum_batch`."""
import os, json, struct, subprocess, sys, time, zlib
from pathlib import Path
import pytest
os.environ.update(WANDB_MODE='offline', WANDB_SILENT='true')
import wandb
from wandb.proto import wandb_internal_pb2 as pb
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from fastai.basics import *
from fastai.callback.wandb import WandbCallback
from fastai.callback.tensorboard import TensorBoardCallback
from fastxtend_accum.callback.gradaccum import GradientAccumulation
from fastxtend_accum.callback.schedule import GradientAccumulationSchedule
import fastxtend_accum.patches  # noqa: F401 the patches
from fastxtend_accum.test_utils import digits_learner

# ---- reading an offline W&B run: the `.wandb` file is a LevelDB-style log of `wandb_internal_pb2.Record`s ----
_BLOCK,_HDR = 32768,7

def wandb_records(path):
    ("Every `Record` in a `.wandb` file: 32 KiB blocks of (crc32, length, kind) chunks, a record split over "
     "FIRST/MIDDLE/LAST")
    data = Path(path).read_bytes()
    ident,magic,version = struct.unpack('<4sHB', data[:_HDR])
    assert (ident,magic,version) == (b':W&B', 0xBEE1, 0), (ident, magic, version)
    pos,buf = _HDR,b''
    while pos + _HDR <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HDR: pos += left; continue # a block's tail too short for a header is padding
        crc,n,kind = struct.unpack('<IHB', data[pos:pos+_HDR])
        if (crc,n,kind) == (0,0,0): pos += left; continue
        chunk = data[pos+_HDR:pos+_HDR+n]; pos += _HDR+n
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) & 0xffffffff == crc, f'bad checksum at {pos}'
        buf = chunk if kind in (1,2) else buf + chunk
        if kind in (1,4):
            r = pb.Record(); r.ParseFromString(buf); yield r

def wandb_run(run, timeout=60):
    "History rows (a dict per row, in order) and the config of a finished offline run"
    f, = Path(run.settings.sync_dir).glob('*.wandb')
    # `run.finish()` can return before wandb-core has written everything: the file is complete once it ends with `exit`
    t0 = time.time()
    while True:
        try: records = list(wandb_records(f))
        except AssertionError: records = []  # a chunk being written
        if records and records[-1].WhichOneof('record_type') == 'exit': break
        assert time.time()-t0 < timeout, f'{f} has no exit record after {timeout}s'
        time.sleep(0.1)
    rows,config = [],{}
    for r in records:
        kind = r.WhichOneof('record_type')
        if kind == 'history':
            rows.append({(i.key or '/'.join(i.nested_key)): json.loads(i.value_json) for i in r.history.item})
        if kind == 'config': config.update({i.key: json.loads(i.value_json) for i in r.config.update})
    return rows,config

def tb_scalars(log_dir):
    ea = EventAccumulator(str(log_dir)); ea.Reload()
    return {k: [(e.step, e.value) for e in ea.Scalars(k)] for k in ea.Tags()['scalars']}

# ---- what the run did, seen from inside ----
class Windows(Callback):
    "Each optimizer step: epoch, last micro-batch, samples, window loss, and the window's wall time measured here"
    order = WandbCallback.order-0.5 # after the Recorder, just before W&B: the same span as W&B's, without its logging
    def before_fit(self): self.rows,self.t0 = [],None
    def before_batch(self):
        if self.training and self.t0 is None: self.t0 = time.perf_counter()
    def after_batch(self):
        cb = (
            self.learn.gradient_accumulation
            if hasattr(self.learn, 'gradient_accumulation')
            else self.gradient_accumulation_schedule
        )
        if self.training and cb.window_closed:
            self.rows.append(dict(epoch=self.epoch, iter=self.iter, n=cb.windows.window.samples, loss=self.loss.item(),
                                  time=time.perf_counter()-self.t0, n_iter=self.n_iter))
            self.t0 = None

def train_logged(tmp_path, accum_cb, n_epoch, one_cycle):
    run = wandb.init(project='fastxtend-accum-tests', dir=str(tmp_path), mode='offline')
    learn = digits_learner(16, n_train=500, cbs=[accum_cb, Windows()] if accum_cb is not None else None)
    try:
        with learn.no_logging(), learn.no_bar():
            cbs = [
                WandbCallback(log_preds=False),
                TensorBoardCallback(tmp_path / 'tb', trace_model=False, log_preds=False),
            ]
            if one_cycle: learn.fit_one_cycle(n_epoch, 0.1, cbs=cbs)
            else: learn.fit(n_epoch, cbs=cbs)
    finally: run.finish()
    rows,config = wandb_run(run)
    return learn,rows,config,tb_scalars(tmp_path/'tb')

def test_per_optimizer_step(tmp_path):
    "log_accum_batch=True, a schedule from 32 to 128 and fit_one_cycle"
    n_epoch = 2
    learn, rows, config, tb = train_logged(
        tmp_path, GradientAccumulationSchedule(32, 128, finish=0.5), n_epoch, one_cycle=True
    )
    rec,win = learn.recorder,learn.windows.rows
    n_steps = learn.gradient_accumulation_schedule.n_steps
    assert n_steps == len(win) == len(rec.losses) < n_epoch*32

    # W&B: one row per optimizer step, its step counting optimizer steps
    train = [r for r in rows if 'train_loss' in r]
    assert len(rows) == len(train) == n_steps
    assert [r['_step'] for r in train] == list(range(n_steps))
    assert [r['train_loss'] for r in train] == pytest.approx([float(o) for o in rec.losses], rel=1e-12)
    assert [r['raw_loss'] for r in train] == pytest.approx([w['loss'] for w in win], rel=1e-12) # the window's loss
    assert [r['lr_0'] for r in train] == pytest.approx(rec.hps['lr'], rel=1e-12)
    assert [r['mom_0'] for r in train] == pytest.approx(rec.hps['mom'], rel=1e-12)
    assert (
        [r['accum_bs'] for r in train] == rec.hps['accum_bs']
        and rec.hps['accum_bs'][0] == 32
        and max(rec.hps['accum_bs']) == 128
    )
    # fastxtend's key, for dashboards that query it
    assert [r['accumulation_batch_size'] for r in train] == rec.hps['accum_bs']
    # accum_bs is what each window held: an epoch's short last window (500 = 31*16 + 4) logs its real sample count
    assert rec.hps['accum_bs'] == [w['n'] for w in win] and rec.hps['accum_bs'][-1] < 128
    # the epoch axis: epochs done at each window's end, in micro-batches; whole at each epoch's end
    assert [r['epoch'] for r in train] == pytest.approx([w['epoch'] + (w['iter']+1)/w['n_iter'] for w in win], abs=1e-9)
    ends = [k for k,w in enumerate(win) if w['iter'] == w['n_iter']-1]
    assert [train[k]['epoch'] for k in ends] == list(range(1, n_epoch+1))
    assert [k for k,r in enumerate(train) if 'valid_loss' in r] == ends
    assert [train[k]['valid_loss'] for k in ends] == pytest.approx([v[1] for v in rec.values], rel=1e-12)
    # samples/sec counts the whole window: the window's samples over its time, as measured here. A micro-batch's samples
    # over the window's time, or a window's samples over a micro-batch's time, would be 6x to 8x off for these windows;
    # timing noise on a busy CPU is far less than that.
    big = [k for k,w in enumerate(win) if w['n'] >= 6*16]
    assert len(big) >= 4
    ratios = [train[k]['train_samples_per_sec']/(win[k]['n']/win[k]['time']) for k in big]
    print('samples/sec ratios', [round(q, 3) for q in ratios])
    assert all(0.4 < q < 2.5 for q in ratios) and 0.8 < sorted(ratios)[len(ratios)//2] < 1.25, ratios
    # the config is written on fastai 2.8.12 too (its own formatting crashes on fastcore 2)
    assert config['GradientAccumulationSchedule']['start_accum_bs'] == 32
    assert config['GradientAccumulationSchedule']['final_accum_bs'] == 128
    assert config['Learner']['lr'] == 0.1 and 'dls' not in config['Learner']

    # TensorBoard: one point per optimizer step, at the micro-batch step where its window ends
    ends_at = [w['epoch']*w['n_iter'] + w['iter'] + 1 for w in win]
    assert [s for s,_ in tb['train_loss']] == ends_at
    assert [v for _,v in tb['train_loss']] == pytest.approx([float(o) for o in rec.losses], rel=1e-6)
    assert [s for s,_ in tb['accum_bs']] == ends_at and [v for _,v in tb['accum_bs']] == rec.hps['accum_bs']
    assert tb['accumulation_batch_size'] == tb['accum_bs'] # fastxtend's key
    assert [v for _,v in tb['lr_0']] == pytest.approx(rec.hps['lr'], rel=1e-6)
    assert [s for s,_ in tb['valid_loss']] == [ends_at[k] for k in ends]

def test_per_micro_batch(tmp_path):
    "log_accum_batch=False: fastai's rows (one per micro-batch), with the window's size added"
    n_epoch = 2
    learn, rows, config, tb = train_logged(
        tmp_path, GradientAccumulation(64, log_accum_batch=False), n_epoch, one_cycle=False
    )
    rec = learn.recorder
    n_mb = n_epoch*32
    assert learn.gradient_accumulation.n_steps == len(learn.windows.rows) == n_epoch*8
    train = [r for r in rows if 'train_loss' in r]
    assert len(rows) == len(train) == n_mb == len(rec.losses)
    assert [r['_step'] for r in train] == list(range(n_mb))
    assert [r['train_loss'] for r in train] == pytest.approx([float(o) for o in rec.losses], rel=1e-12)
    assert [r['epoch'] for r in train] == pytest.approx(
        [e + (i + 1) / 32 for e in range(n_epoch) for i in range(32)], abs=1e-9
    )
    # the window's target on its micro-batches, what it held on its last one: 500 = 7*64 + 52
    assert [r['accum_bs'] for r in train] == ([64]*31 + [52])*n_epoch
    # TensorBoard: fastai's steps, and fastai's repeats of the last point during validation (2 validation batches)
    assert sorted({s for s,_ in tb['train_loss']}) == list(range(1, n_mb+1))
    assert len(tb['train_loss']) == n_mb + n_epoch*len(learn.dls.valid)
    assert [s for s,_ in tb['accum_bs']] == list(range(1, n_mb+1))

def test_without_accumulation(tmp_path):
    ("No accumulation callback: fastai's own code, so fastai's rows and no `accum_bs` (and on fastcore 2, fastai "
     "2.8.12's own crash)")
    import fastai.callback.wandb as fw
    # fastai 2.8.12 on fastcore 2: fastai's bug, left as fastai ships it
    if 'init_args' in fw._format_config_value.__code__.co_names:
        with pytest.raises(TypeError, match='vars'): train_logged(tmp_path, None, 1, one_cycle=False)
        return
    learn,rows,config,tb = train_logged(tmp_path, None, 1, one_cycle=False)
    assert len(rows) == 32 and [r['_step'] for r in rows] == list(range(32))
    assert [r['train_loss'] for r in rows] == pytest.approx([float(o) for o in learn.recorder.losses], rel=1e-12)
    assert not any('accum_bs' in r for r in rows) and 'accum_bs' not in tb
    assert len(tb['train_loss']) == 32 + len(learn.dls.valid)

def test_no_vision_import():
    """The library imports neither fastai.vision, torchvision nor wandb; fastai's own TensorBoard module, which users
    import to log, brings `fastai.vision.core`/`.data` but never torchvision"""
    code = (
        "import sys; vis = lambda: sorted(m for m in sys.modules if m.split('.')[0] in ('torchvision', 'wandb') or "
        "m.startswith('fastai.vision')); "
        "import fastxtend_accum.all; print(vis()); import fastai.callback.tensorboard; print(vis())"
    )
    out = (
        subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, check=True)
        .stdout.strip()
        .split('\n')
    )
    assert out == ["[]", "['fastai.vision', 'fastai.vision.core', 'fastai.vision.data']"], out

WANDB_AFTER = """
import os, sys; os.environ.update(WANDB_MODE='offline', WANDB_SILENT='true')
from fastxtend_accum.all import *
from fastxtend_accum.test_utils import digits_learner
from fastai.callback.wandb import WandbCallback # after this library
import wandb
run = wandb.init(project='fastxtend-accum-tests', dir=sys.argv[1], mode='offline')
learn = digits_learner(16, n_train=200, cbs=GradientAccumulation(64)) # an accumulating fit: its W&B callback gets \
the fix
with learn.no_bar(), learn.no_logging(): learn.fit(1, cbs=WandbCallback(log_preds=False, log_model=False))
run.finish()
print(len(learn.recorder.losses))
"""

def test_wandb_fix_whatever_the_import_order(tmp_path):
    ("fastai.callback.wandb imported after this library: an accumulating fit's fastcore-2 fix still applies (fastai "
     "2.8.12 crashes in before_fit without it)")
    out = subprocess.run([sys.executable, '-c', WANDB_AFTER, str(tmp_path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().split('\n')[-1] == '4' # 200 samples in batches of 64: the fit ran to its end

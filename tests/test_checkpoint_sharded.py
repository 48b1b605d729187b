"""Sharded checkpoints (`checkpoint_sharded`: `torch.distributed.checkpoint`) of a fastai fit in `learn.sharded_ctx()`
(FSDP2, torchrun, gloo, CPU, float64): saved after the first epoch's optimizer steps, the fit cancelled, new processes
load it and train on, equal to the fit that was not cut; the state loaded on 1 or 2 processes from a checkpoint of 2 or
1 is the state saved, exactly; DCP's index is read as data (no code of it runs). The workers are
`checkpoint_sharded_worker.py`."""
import os, re, subprocess
import pytest, torch
pytestmark = [pytest.mark.multiprocess]
from test_distributed import torchrun
from test_sharded import opt_diff, max_diff

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, 'checkpoint_sharded_worker.py')
ENV = dict(os.environ, OMP_NUM_THREADS='1', PYTHONWARNINGS='ignore', TORCH_GLOO_LAZY_INIT='1')
TIMEOUT = 600 # seconds for a whole launch (2 loaded cores); a collective that hangs fails after the worker's PG_TIMEOUT

def launch(out, cases, n=2, src=None):
    "Run the cases on `n` processes under torchrun (bounded); what each rank wrote, by case"
    out.mkdir(parents=True, exist_ok=True)
    cmd = torchrun(n, WORKER, out, ','.join(cases), max_restarts=0)
    cmd += [str(src)] if src else []
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT, env=ENV, cwd=os.path.dirname(HERE))
    errors = '\n'.join(l for l in p.stderr.splitlines() if re.search(r'\[rank\d\]: \S*(Error|Exception)\b', l))
    assert p.returncode == 0, p.stdout[-3000:] + '\n' + errors[-4000:] + '\n' + p.stderr[-3000:]
    return {c: [torch.load(out/f'{c}-rank{r}.pt', weights_only=False) for r in range(n)] for c in cases}

@pytest.fixture(scope='module')
def runs(tmp_path_factory):
    "Saved on 2 processes; loaded on 2 and on 1; saved on 1 and loaded on 2"
    d = tmp_path_factory.mktemp('ck')
    two = launch(d/'two', ['cut', 'whole', 'cut_adamw', 'fsdp1'])
    return dict(two=two, two_two=launch(d/'two_two', ['resume', 'fresh', 'resume_adamw', 'mismatch'], src=d/'two'),
                two_one=launch(d/'two_one', ['resume', 'resume_adamw', 'cut', 'cut_adamw'], n=1, src=d/'two'),
                one_two=launch(d/'one_two', ['resume', 'resume_adamw'], src=d/'two_one'), dir=d)

def state_diff(a, b)->tuple[float,float]:
    "Largest differences of the model's and the optimizer's states (gathered whole)"
    return max((a['model'][k] - b['model'][k]).abs().max().item() for k in b['model']),opt_diff(a['opt'], b['opt'])

def test_files(runs):
    "Each process wrote its own shards; the plain values are JSON beside DCP's metadata"
    files = sorted(os.listdir(runs['dir']/'two'/'ck_cut'))
    assert files == ['.metadata', '__0_0.distcp', '__1_0.distcp', 'sharded.json', 'shuffle.pt'] # shuffle.pt: the test's

@pytest.mark.parametrize('opt', ['', '_adamw'])
def test_resumed_equals_whole_run(runs, opt):
    "2 -> 2: the state loaded is the state saved, and the second epoch trained after it ends where the uncut fit ends"
    cut,new = runs['two'][f'cut{opt}'][0],runs['two_two'][f'resume{opt}']
    for r in new:
        d = state_diff(r['loaded'], cut['saved'])
        print(f'2 -> 2{opt}: loaded vs saved: model {d[0]:.3g}, optimizer {d[1]:.3g}; saved by {r["loaded_from"]}')
        assert max(d) == 0 and r['loaded_from'] == dict(world_size=2, engine='fsdp2')
    if opt: return
    whole = runs['two']['whole'][0]
    assert max(state_diff(whole['saved'], cut['saved'])) == 0 # the same run up to the cut
    for r in new:
        d,o = max_diff(r['params'], whole['params']),opt_diff(r['opt'], whole['opt'])
        print(f'2 -> 2: after the second epoch vs the fit not cut: parameters {d:.3g}, optimizer state {o:.3g}')
        assert d < 1e-8 and o < 1e-8
        assert r['model_type'] == 'Sequential' and r['param_types'] == ['Parameter'] # plain again after the fit

def test_fresh_start_is_off(runs):
    "The test has teeth: the same second epoch without loading the checkpoint ends elsewhere"
    whole = runs['two']['whole'][0]
    d = max_diff(runs['two_two']['fresh'][0]['params'], whole['params'])
    print(f'without load_sharded: parameters {d:.3g} from the fit not cut')
    assert d > 1e-3

@pytest.mark.parametrize('way', ['two_one', 'one_two'])
@pytest.mark.parametrize('opt', ['', '_adamw'])
def test_other_number_of_processes_reshards_exactly(runs, way, opt):
    "2 -> 1 and 1 -> 2 processes: DCP reshards FSDP2's DTensors; the state loaded is the state saved, bit for bit"
    src,n_saved = (runs['two'], 2) if way == 'two_one' else (runs['two_one'], 1)
    cut = src[f'cut{opt}'][0]
    for r in runs[way][f'resume{opt}']:
        d = state_diff(r['loaded'], cut['saved'])
        print(f'{n_saved} -> {r["world"]}{opt}: loaded vs saved: model {d[0]:.3g}, optimizer {d[1]:.3g}')
        assert max(d) == 0 and r['loaded_from']['world_size'] == n_saved and r['world'] != n_saved

def test_refusals(runs):
    "FSDP1 is refused naming FSDP2; another model is refused on every process, naming keys, shapes and process counts"
    for r in runs['two']['fsdp1']:
        assert set(r) == {'save_sharded', 'load_sharded'}
        assert all('do not support FSDP1' in e and 'FSDP2' in e for e in r.values())
    errs = [r['error'] for r in runs['two_two']['mismatch']]
    print(errs[0])
    assert errs[0] == errs[1] and 'saved on 2 processes, loaded on 2' in errs[0]
    assert 'model/0.weight (32, 64) saved, (16, 64) now' in errs[0]

class Plants:
    "Unpickled, creates the file `path`: what a checkpoint's code could do at a load"
    def __init__(self, path): self.path = path
    def __reduce__(self): return (open, (str(self.path), 'w'))

@pytest.mark.parametrize('where', ['whole', 'inside'])
def test_index_is_read_as_data(tmp_path, where):
    """DCP's `.metadata` replaced by a pickle that creates a file (the whole file, or a value deep inside a real index):
    load_sharded refuses it naming the file and the global, the file is not created, the model is unchanged; the plain
    `pickle.load` DCP's own reader uses would have created it (1 process, no process group)"""
    import pickle, warnings
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata
    from fastai.optimizer import Adam
    from fastxtend_accum.checkpoint_sharded import save_sharded, load_sharded, _DataReader
    from fastxtend_accum.test_utils import digits_mlp
    warnings.filterwarnings('ignore', message='torch.distributed is disabled')
    m = digits_mlp(seed=0)
    save_sharded(tmp_path/'ck', m, Adam(list(m.parameters()), lr=1e-3))
    f,marker = tmp_path/'ck'/'.metadata',tmp_path/'ran'
    good = f.read_bytes()
    index = pickle.loads(good)
    if where == 'inside': index.planner_data = Plants(marker)
    f.write_bytes(pickle.dumps(index if where == 'inside' else Plants(marker)))
    m2 = digits_mlp(seed=1)
    before = {k: v.clone() for k,v in m2.state_dict().items()}
    with pytest.raises(ValueError) as e: load_sharded(tmp_path/'ck', m2, Adam(list(m2.parameters()), lr=1e-3))
    print(e.value)
    assert f"{f} is refused: its pickle calls io.open" in str(e.value)
    assert not marker.exists()
    with pytest.raises(pickle.UnpicklingError, match='calls io.open'): _DataReader(tmp_path/'ck').read_metadata()
    assert not marker.exists() and all(torch.equal(v, m2.state_dict()[k]) for k,v in before.items())
    pickle.loads(f.read_bytes()) # the control: read as DCP's FileSystemReader reads it, it runs
    assert marker.exists()
    # an entry DCP would read from the .distcp files with torch.load(weights_only=False); a file outside the folder
    index = pickle.loads(good)
    index.state_dict_metadata['model/0.weight'] = BytesStorageMetadata()
    f.write_bytes(pickle.dumps(index))
    with pytest.raises(ValueError, match='calls torch.distributed.checkpoint.metadata.BytesStorageMetadata'):
        load_sharded(tmp_path/'ck', m2, Adam(list(m2.parameters()), lr=1e-3))
    index = pickle.loads(good)
    next(iter(index.storage_data.values())).relative_path = '../elsewhere.distcp'
    f.write_bytes(pickle.dumps(index))
    with pytest.raises(ValueError, match="points to '../elsewhere.distcp', which is not a file of its folder"):
        load_sharded(tmp_path/'ck', m2, Adam(list(m2.parameters()), lr=1e-3))
    f.write_bytes(good) # the real index loads
    load_sharded(tmp_path/'ck', m2, Adam(list(m2.parameters()), lr=1e-3))
    assert all(torch.equal(v, m2.state_dict()[k]) for k,v in m.state_dict().items())

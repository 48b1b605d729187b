"""The store's load from fail-fast, against the number of processes: a `TCPStore` served here, and N simulated processes
(worker processes, each with N/W clients of their own, as many connections as N processes open) watching it for a fit's
failure for `--seconds`; then a failure is announced, and the time until every watcher knows is measured.

`polling`: the landed watch (one `check` of the news key every 0.2 s per process). `blocking`: `failfast.Watch` (one
blocking `wait` per process, on its own connection, answered by the store when the news comes).

    PYTHONPATH=. .venv/bin/python bench/failfast_store.py [--n 8 32 128 256] [--seconds 20] [--workers 4]"""
import argparse, multiprocessing as mp, socket, time
from datetime import timedelta

def _free_port():
    with socket.socket() as s: s.bind(('127.0.0.1', 0)); return s.getsockname()[1]

def _watch(kind, port, ranks, world, q):
    ("One simulated node: a store client per rank; each watches as `kind` does; report (requests before the news, "
     "wake latency)")
    import threading
    import torch.distributed as dist
    from fastxtend_accum import failfast as F
    stores = [dist.TCPStore('127.0.0.1', port, is_master=False, timeout=timedelta(seconds=60)) for _ in ranks]
    stats,lock = [],threading.Lock()
    def polling(store, rank):
        n,news,t0 = 0,f'{F.NEWS_KEY}0',time.time()
        while True:
            n += 1
            if store.check([news]): break
            time.sleep(F.POLL_S)
        with lock: stats.append((n-1, t0, time.time())) # the checks made before the news
    def blocking(store, rank):
        t0 = time.time()
        w = F.Watch(lambda: False, store=store, world=world, rank=rank)
        while w.failed is None: time.sleep(.005)
        t = time.time()
        w.close()
        with lock: stats.append((w.waiter.requests, t0, t)) # the requests made before the news: the waiter's one wait
    f = polling if kind == 'polling' else blocking
    ts = [threading.Thread(target=f, args=(s, r), daemon=True) for s,r in zip(stores, ranks)]
    for t in ts: t.start()
    q.put('ready')
    for t in ts: t.join()
    q.put(stats)

def measure(kind, n, seconds, workers):
    import torch.distributed as dist
    from fastxtend_accum import failfast as F
    port = _free_port()
    server = dist.TCPStore('127.0.0.1', port, is_master=True, timeout=timedelta(seconds=60), wait_for_workers=False)
    ctx = mp.get_context('spawn')
    q = ctx.Queue()
    ps = [ctx.Process(target=_watch, args=(kind, port, list(range(w, n, workers)), n, q)) for w in range(workers)]
    for p in ps: p.start()
    for _ in ps: assert q.get(timeout=300) == 'ready' # every watcher runs
    time.sleep(seconds) # each watcher's rate: over its own time before the news
    t_news = time.time()
    F._news(server, 0, '1\tValueError: a bad batch') # what a failing process writes
    stats = [s for _ in ps for s in q.get(timeout=120)]
    for p in ps: p.join(timeout=30)
    assert len(stats) == n
    return dict(n=n, kind=kind, per_s=sum(r/(t_news-t0) for r,t0,_ in stats), total=sum(r for r,*_ in stats),
                wake=max(t for *_,t in stats) - t_news)

if __name__ == '__main__':
    ap = argparse.ArgumentParser()
    ap.add_argument('--n', type=int, nargs='+', default=[8, 32, 128, 256])
    ap.add_argument('--seconds', type=float, default=20.)
    ap.add_argument('--workers', type=int, default=4)
    a = ap.parse_args()
    print(f'{a.seconds:.0f} s of a fit, then a failure: requests to the store while nothing failed, and the wake-up')
    print(f'{"processes":>9}  {"polling: requests":>17}  {"per s":>7}  {"wake (s)":>8}  {"blocking: requests":>18}  '
          f'{"per s":>6}  {"wake (s)":>8}')
    for n in a.n:
        old,new = (measure(k, n, a.seconds, a.workers) for k in ('polling', 'blocking'))
        print(f'{n:>9}  {old["total"]:>17,}  {old["per_s"]:>7,.1f}  {old["wake"]:>8.2f}  {new["total"]:>18,}  '
              f'{new["per_s"]:>6,.2f}  {new["wake"]:>8.2f}', flush=True)

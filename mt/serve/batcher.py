"""``mt serve``'s decoding: the sentences of concurrent requests, decoded together.

Each of ``workers`` processes runs a continuous beam search per beam size
(``mt.decode.continuous``): a sentence joins a search under way at a step
boundary and is answered as soon as it is finished, so the batch stays
full while sentences keep coming. Processes rather than threads: a step of
a small model spends much of its time in Python, and decoding threads of
one process wait for each other's turn at the interpreter lock
(docs/serving.md). The server's process keeps the event loop, the tokenizer
and the texts; a worker gets token ids and sends back token ids.

A worker lets waiting sentences into a search under way once they are a
quarter of the search's count, or the first has waited
``JOIN_WAITS * max_wait``: each join runs the encoder and copies the whole
cache, so joins are rationed rather than made at every step. An idle worker waits up to
``max_wait`` from the first arrival, so that sentences sent together start
together. Each sentence goes to the ready worker with the fewest outstanding.

What the server can rely on, whatever a worker does:

* The event loop never waits on a worker: jobs go to a worker through a
  queue and a sender thread of its own, results come back on a reader
  thread, so a stopped worker whose pipe is full blocks only its sender.
* A busy worker reports at least every ``HEARTBEAT_S``. One that has
  sentences and reports nothing for ``stall_s`` is killed; its sentences
  (and only its) fail, and a new process takes its place.
* A request has a deadline; past it, or when its client goes, its sentences
  are dropped from the queue and from the search they were in.
* At most ``max_queue`` sentences are outstanding; past that a request is
  refused at once rather than queued (``Overloaded``).
* Once a stop has begun (``drain``), no process starts: a worker that ends
  is not replaced. ``stop`` takes no more requests and lets the workers
  finish what they have, within a bound.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import multiprocessing
import queue
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from mt.decode.allocator import keep_freed_memory
from mt.decode.continuous import ContinuousBeamSearch, JoinError, Sentence
from mt.decode.search import SearchSettings
from mt.decode.translator import Translator

JOIN_WAITS = 5
HEARTBEAT_S = 0.5  #: a worker with sentences reports at least this often
STARTUP_S = 300.0  #: the longest a new worker may take to load its model before it counts as hung
LATE_S = 10.0  #: ``health`` calls a busy worker "stalled" after this long without a report


class Options(NamedTuple):
    """A request's search options."""

    beam: int
    alpha: float
    n_best: int


class DecodingError(RuntimeError):
    """A sentence was not decoded, for a reason that a later try may not meet (503)."""


class Overloaded(DecodingError):
    """The queue is full: the request is refused at once (503)."""


class DecodingTimeout(RuntimeError):
    """A request was not decoded by its deadline (504)."""


@dataclass
class _Job:
    src: list[int]
    prefix: str
    prefix_ids: list[int]
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop

    def answer(self, result=None, error: BaseException | None = None) -> None:
        """Hand the result (or the error) to the request waiting on the event loop."""

        def settle() -> None:
            if not self.future.done():  # the request may have ended (deadline, client gone)
                self.future.set_exception(error) if error is not None else self.future.set_result(result)

        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody waits
            self.loop.call_soon_threadsafe(settle)


@dataclass
class _Worker:
    """One decoding process, seen from the server: its pipes, its outstanding jobs, its clock."""

    process: multiprocessing.Process
    outbox: queue.SimpleQueue  # messages to the process, sent by its sender thread
    receive: object  # Connection: results from it
    started: float  # time.monotonic() at start
    jobs: dict[int, _Job] = field(default_factory=dict)
    joins: int = 0
    alive: bool = True
    ready: bool = False  # it has loaded its model and said so
    heard: float = 0.0  # the last report, or when it last became busy, whichever is later
    why: str | None = None  # why the server killed it, if it did


class Batcher:
    """Sends each sentence to a decoding process and answers its request with the result.

    ``max_queue``: most sentences outstanding at once; ``stall_s``: how long a worker with
    sentences may go without a report before it is killed and replaced."""

    def __init__(
        self,
        translator: Translator,
        max_batch: int = 64,
        max_wait_ms: float = 10.0,
        workers: int = 1,
        max_queue: int = 1024,
        stall_s: float = 30.0,
    ):
        self.translator = translator
        self.max_batch, self.max_wait = max_batch, max_wait_ms / 1000
        self.max_queue, self.stall_s = max_queue, stall_s
        self.threads = max(1, torch.get_num_threads() // workers)  # PyTorch threads per worker
        self.size = workers
        self.workers: list[_Worker] = []
        self.next_id = 0
        self.draining = False  # a stop has begun: no ended worker is replaced
        self.stopping = False  # the server has stopped taking requests: none is placed
        self.lock = threading.Lock()  # the workers and their job tables: the event loop adds, threads take
        self.ended = threading.Event()  # stop() was called: the watchdog ends

    @property
    def joins(self) -> int:
        """How many times the workers let waiting sentences into their searches: what tells
        continuous batching (sentences joining a search under way) from a batch at a time."""
        return sum(w.joins for w in self.workers)

    def queued(self) -> int:
        """Sentences sent to workers and not answered yet."""
        return sum(len(w.jobs) for w in self.workers)

    def start(self) -> None:
        self.workers = [self._spawn() for _ in range(self.size)]
        threading.Thread(target=self._watch, name="mt-serve-watchdog", daemon=True).start()
        # at exit multiprocessing ends the workers (daemons): they are not to be replaced then
        atexit.register(self.drain)

    def drain(self) -> None:
        """A stop has begun: the requests in flight are still decoded, but no process is started
        any more (a worker that ends now is not replaced; its sentences fail)."""
        with self.lock:
            self.draining = True

    def _spawn(self) -> _Worker:
        ctx = multiprocessing.get_context("spawn")  # no fork of a process with threads
        jobs_out, jobs_in = ctx.Pipe(duplex=False)
        results_out, results_in = ctx.Pipe(duplex=False)
        t = self.translator
        process = ctx.Process(
            target=_decode, args=(t.model, t.settings, jobs_out, results_in, self.threads, self.max_batch,
                                  self.max_wait), name="mt-serve-decoder", daemon=True,
        )  # fmt: skip
        process.start()
        jobs_out.close()
        results_in.close()
        worker = _Worker(process, queue.SimpleQueue(), results_out, started=time.monotonic())
        threading.Thread(target=_send, args=(worker.outbox, jobs_in), name="mt-serve-jobs", daemon=True).start()
        threading.Thread(target=self._read, args=(worker,), name="mt-serve-results", daemon=True).start()
        return worker

    async def translate(self, lines: list[str], prefixes: list[str], options: Options, timeout: float | None = None):
        """Per line its n-best (translation, score), once a worker has finished it. A line
        that encodes to no pieces gets what ``mt translate`` gives it: an empty translation.
        Raises ``Overloaded`` or ``DecodingError`` (503) or ``DecodingTimeout`` (504);
        on any of these, or if cancelled, the request's sentences leave the workers."""
        loop = asyncio.get_running_loop()
        ids = self.translator.encode(lines)
        fixed = self.translator.encode_prefixes(prefixes)
        results: list = [None] * len(lines)
        todo = []
        for i, src in enumerate(ids):
            if src:
                todo.append(_Job(src, prefixes[i], fixed[i], loop.create_future(), loop))
            else:
                results[i] = self.translator.texts([([], 0.0)] * options.n_best, prefixes[i], fixed[i])
        if not todo:
            return results
        placed = self._place(todo, options)
        gathered = asyncio.gather(*(job.future for job in todo))
        gathered.add_done_callback(lambda f: f.cancelled() or f.exception())  # read: never "not retrieved"
        try:
            done = await asyncio.wait_for(gathered, timeout)
        except asyncio.TimeoutError:
            self._drop(placed)
            raise DecodingTimeout(f"not translated within {timeout:g} s (--timeout)") from None
        except BaseException:  # a failed sentence, or the request was cancelled: the others go too
            self._drop(placed)
            raise
        answers = iter(done)
        return [r if r is not None else next(answers) for r in results]

    def _place(self, jobs: list[_Job], options: Options) -> list[tuple[_Worker, int]]:
        """Give each job to a worker (ready ones first, the least busy first); (worker, job id) each."""
        now = time.monotonic()
        placed, batches = [], {}
        with self.lock:
            if self.stopping:
                raise DecodingError("the server is stopping")
            queued = self.queued()
            if queued + len(jobs) > self.max_queue:
                raise Overloaded(f"{queued} sentences are queued (--max-queue {self.max_queue})")
            live = [w for w in self.workers if w.alive]
            if not live:
                raise DecodingError("no decoding process is running (one is restarting)")
            for job in jobs:
                worker = min(live, key=lambda w: (not w.ready, len(w.jobs)))
                if not worker.jobs:
                    worker.heard = max(worker.heard, now)  # busy from now: its stall clock starts
                self.next_id += 1
                worker.jobs[self.next_id] = job
                placed.append((worker, self.next_id))
                batches.setdefault(id(worker), (worker, []))[1].append(
                    (self.next_id, job.src, job.prefix_ids, *options, now)
                )
        for worker, batch in batches.values():
            worker.outbox.put(("add", batch))
        return placed

    def _drop(self, placed: list[tuple[_Worker, int]]) -> None:
        """Take these jobs back: unanswered, and out of their workers' searches."""
        by_worker: dict[int, tuple[_Worker, list[int]]] = {}
        with self.lock:
            for worker, job_id in placed:
                if worker.jobs.pop(job_id, None) is not None:
                    by_worker.setdefault(id(worker), (worker, []))[1].append(job_id)
        for worker, job_ids in by_worker.values():
            worker.outbox.put(("drop", job_ids))

    def _fail(self, worker: _Worker) -> None:
        """Mark an ended worker and fail its outstanding jobs (once)."""
        with self.lock:
            worker.alive = False
            failed, worker.jobs = list(worker.jobs.values()), {}
        why = worker.why or f"ended (exit code {worker.process.exitcode})"
        for job in failed:
            job.answer(error=DecodingError(f"the decoding process {why}; try again"))

    def health(self) -> dict:
        """Each worker's state (ok, starting, stalled, restarting) and the service's: ok when
        every worker is, unavailable when none is, degraded between; stopping once it stops."""
        now = time.monotonic()
        with self.lock:
            workers = []
            for w in self.workers:
                if not w.alive:
                    state = "restarting"
                elif not w.ready:
                    state = "starting"
                elif w.jobs and now - w.heard > min(LATE_S, self.stall_s):
                    state = "stalled"
                else:
                    state = "ok"
                workers.append({"pid": w.process.pid, "state": state, "sentences": len(w.jobs)})
            stopping = self.draining
        ok = sum(w["state"] == "ok" for w in workers)
        status = "stopping" if stopping else "ok" if ok == len(workers) else "degraded" if ok else "unavailable"
        return {"status": status, "workers": workers, "queued": sum(w["sentences"] for w in workers),
                "max_queue": self.max_queue}  # fmt: skip

    async def stop(self, timeout: float = 30.0) -> None:
        """Let the workers finish the sentences they have, for up to ``timeout`` seconds; then
        end them. Their sentences still outstanding then fail."""
        with self.lock:
            self.draining = self.stopping = True
        self.ended.set()
        atexit.unregister(self.drain)
        with self.lock:
            workers = list(self.workers)
        for w in workers:
            w.outbox.put(("stop",))
        await asyncio.get_running_loop().run_in_executor(None, _end, workers, timeout)

    def _watch(self) -> None:
        """Kill a worker that has sentences and has not reported for ``stall_s`` (or, not ready
        yet, has not loaded within ``STARTUP_S``): its reader then fails its jobs and replaces it."""
        while not self.ended.wait(min(0.25, self.stall_s / 4)):
            now = time.monotonic()
            with self.lock:
                hung = []
                for w in self.workers:
                    if not w.alive or not w.jobs or w.why:
                        continue
                    if w.ready and now - w.heard > self.stall_s:
                        w.why = f"made no progress for {self.stall_s:g} s and was replaced"
                    elif not w.ready and now - w.started > STARTUP_S:
                        w.why = f"did not start within {STARTUP_S:g} s and was replaced"
                    else:
                        continue
                    hung.append(w)
            for w in hung:
                with contextlib.suppress(OSError):
                    w.process.kill()  # SIGKILL: ends a stopped process too

    def _read(self, worker: _Worker) -> None:
        """Answer the worker's jobs as its results come (a thread per worker); a worker
        that ends unasked fails its outstanding jobs and is replaced, unless stopping."""
        while True:
            try:
                kind, results, worker.joins = worker.receive.recv()
            except (EOFError, OSError):
                break
            worker.heard = time.monotonic()
            if kind == "ready":
                worker.ready = True
            for job_id, outcome in results:
                with self.lock:
                    job = worker.jobs.pop(job_id, None)
                if job is None:  # dropped: its request has ended
                    continue
                if kind == "failed":
                    job.answer(error=DecodingError(outcome))
                    continue
                try:
                    job.answer(self.translator.texts(outcome, job.prefix, job.prefix_ids))
                except Exception as e:  # noqa: BLE001 - the request gets the error, the others go on
                    job.answer(error=e)
        worker.process.join(timeout=5)
        if worker.process.is_alive():  # it closed its pipe yet lives on: it is of no more use
            worker.process.kill()
            worker.process.join(timeout=5)
        worker.outbox.put(None)  # its sender ends
        self._fail(worker)
        with self.lock:
            if self.draining:
                return
        replacement = self._spawn()
        with self.lock:
            self.workers[self.workers.index(worker)] = replacement
            stopped_meanwhile = self.draining
        if stopped_meanwhile:  # stop() may not have seen it: end it here
            replacement.outbox.put(("stop",))
            _end([replacement], 30.0)


def _send(outbox: queue.SimpleQueue, jobs) -> None:
    """A worker's sender thread: messages from the queue into its pipe, until None or the pipe breaks.
    A stopped worker blocks this thread when its pipe fills, never the event loop."""
    while (message := outbox.get()) is not None:
        try:
            jobs.send(message)
        except OSError:  # the worker has ended: its reader fails its jobs
            break
    jobs.close()


def _end(workers: list[_Worker], timeout: float) -> None:
    """Wait for the workers to exit, up to ``timeout`` seconds in all; kill those still running."""
    deadline = time.monotonic() + timeout
    for w in workers:
        w.process.join(max(0.0, deadline - time.monotonic()))
    for w in workers:
        if w.process.is_alive():
            w.why = f"did not finish within {timeout:g} s of the stop"
            w.process.kill()
            w.process.join(timeout=5)


def _decode(model, settings: SearchSettings, jobs, results, threads: int, max_batch: int, max_wait: float) -> None:
    """A worker process: receive sentences, decode them continuously, send back each when finished."""
    # Ctrl-C and SIGTERM reach the whole process group (a terminal, systemd, kill -- -PGID): the
    # server decides when its workers stop, once the requests in flight are answered.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    torch.set_num_threads(threads)
    keep_freed_memory()
    searches: dict[int, ContinuousBeamSearch] = {}
    waiting: list[tuple[float, int, Sentence]] = []  # (arrived, beam, sentence)
    joins = 0
    stopping = False
    last_report = time.monotonic()

    def report(kind: str, done: list) -> None:
        nonlocal last_report
        results.send((kind, done, joins))
        last_report = time.monotonic()

    def receive(timeout: float | None) -> bool:
        """Take one message if one comes within ``timeout`` (None: wait for it). False if none came."""
        nonlocal stopping, waiting
        if timeout is not None and not jobs.poll(max(timeout, 0.0)):
            return False
        message = jobs.recv()
        if message[0] == "stop":
            stopping = True
        elif message[0] == "drop":
            gone = set(message[1])
            waiting = [w for w in waiting if w[2].tag not in gone]
            for search in searches.values():
                search.drop(gone)
        else:
            for job_id, src, prefix, beam, alpha, n_best, arrived in message[1]:
                waiting.append((arrived, beam, Sentence(src, prefix, alpha, n_best, job_id)))
        return True

    try:
        report("ready", [])
        while True:
            under_way = sum(len(search) for search in searches.values())
            if not under_way and not waiting:
                if stopping:
                    return
                receive(None)
                continue
            if not under_way:  # idle: give the sentences sent together the time to arrive
                deadline = waiting[0][0] + max_wait
                while len(waiting) < max_batch and not stopping and receive(deadline - time.monotonic()):
                    pass
            else:
                while receive(0):
                    pass
            # a join costs more the fuller the search: let a quarter of it in at once, or whoever has
            # waited JOIN_WAITS times max_wait (about four steps of a full search)
            ready = not under_way or stopping or len(waiting) >= under_way // 4
            if (
                waiting
                and under_way < max_batch
                and (ready or time.monotonic() - waiting[0][0] >= JOIN_WAITS * max_wait)
            ):
                taken, waiting = waiting[: max_batch - under_way], waiting[max_batch - under_way :]
                for _, beam, sentence in taken:
                    try:
                        if beam not in searches:
                            searches[beam] = ContinuousBeamSearch(model, settings, beam)
                        searches[beam].add([sentence])
                    except Exception as e:  # noqa: BLE001 - this sentence fails, the others go on
                        report("failed", [(sentence.tag, f"{type(e).__name__}: {e}")])
                joins += 1
            for beam, search in list(searches.items()):
                if not len(search):
                    continue
                try:
                    done = [(x.tag, [(h.tokens, h.score) for h in hyps]) for x, hyps in search.step()]
                    kind = "done"
                except JoinError as e:  # the joiners fail; the sentences under way go on
                    done, kind = [(x.tag, str(e)) for x in e.sentences], "failed"
                except Exception as e:  # noqa: BLE001 - its sentences fail, the worker goes on
                    done = [(x.tag, f"{type(e).__name__}: {e}") for x in search.sentences + search.waiting]
                    kind = "failed"
                    del searches[beam]
                if done:
                    report(kind, done)
            if time.monotonic() - last_report >= HEARTBEAT_S:
                report("busy", [])
    except (EOFError, OSError, KeyboardInterrupt):
        return  # the server has gone

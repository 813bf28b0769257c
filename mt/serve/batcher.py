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
together. Each sentence goes to the worker with the fewest outstanding.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import multiprocessing
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from mt.decode.allocator import keep_freed_memory
from mt.decode.continuous import ContinuousBeamSearch, Sentence
from mt.decode.search import SearchSettings
from mt.decode.translator import Translator

JOIN_WAITS = 5


class Options(NamedTuple):
    """A request's search options."""

    beam: int
    alpha: float
    n_best: int


class _Job(NamedTuple):
    src: list[int]
    prefix: str
    prefix_ids: list[int]
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop

    def answer(self, result=None, error: BaseException | None = None) -> None:
        """Hand the result (or the error) to the request waiting on the event loop."""

        def settle() -> None:
            if not self.future.done():  # the client may have gone
                self.future.set_exception(error) if error is not None else self.future.set_result(result)

        self.loop.call_soon_threadsafe(settle)


class DecodingError(RuntimeError):
    """A worker could not decode a sentence (the message says why)."""


@dataclass
class _Worker:
    """One decoding process, seen from the server: its pipes and its outstanding jobs."""

    process: multiprocessing.Process
    send: object  # Connection: jobs to the process
    receive: object  # Connection: results from it
    jobs: dict[int, _Job] = field(default_factory=dict)
    joins: int = 0
    alive: bool = True


class Batcher:
    """Sends each sentence to a decoding process and answers its request with the result."""

    def __init__(self, translator: Translator, max_batch: int = 64, max_wait_ms: float = 10.0, workers: int = 1):
        self.translator = translator
        self.max_batch, self.max_wait = max_batch, max_wait_ms / 1000
        self.threads = max(1, torch.get_num_threads() // workers)  # PyTorch threads per worker
        self.size = workers
        self.workers: list[_Worker] = []
        self.next_id = 0
        self.stopping = False
        self.lock = threading.Lock()  # the workers' job tables: the event loop adds, reader threads take

    @property
    def joins(self) -> int:
        """How many times the workers let waiting sentences into their searches: what tells
        continuous batching (sentences joining a search under way) from a batch at a time."""
        return sum(w.joins for w in self.workers)

    def start(self) -> None:
        self.workers = [self._spawn() for _ in range(self.size)]
        # at exit multiprocessing ends the workers (daemons): they are not to be replaced then
        atexit.register(self._exiting)

    def _exiting(self) -> None:
        self.stopping = True

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
        worker = _Worker(process, jobs_in, results_out)
        threading.Thread(target=self._read, args=(worker,), name="mt-serve-results", daemon=True).start()
        return worker

    async def translate(self, lines: list[str], prefixes: list[str], options: Options) -> list:
        """Per line its n-best (translation, score), once a worker has finished it."""
        loop = asyncio.get_running_loop()
        ids = self.translator.encode(lines)
        fixed = self.translator.encode_prefixes(prefixes)
        jobs = [_Job(*x, loop.create_future(), loop) for x in zip(ids, prefixes, fixed)]
        now = time.monotonic()
        batches: dict[int, tuple[_Worker, list]] = {}
        with self.lock:
            live = [w for w in self.workers if w.alive]
            for job in jobs:
                if not live:
                    job.answer(error=DecodingError("the decoding process ended and is restarting; try again"))
                    continue
                worker = min(live, key=lambda w: len(w.jobs))
                self.next_id += 1
                worker.jobs[self.next_id] = job
                batches.setdefault(id(worker), (worker, []))[1].append(
                    (self.next_id, job.src, job.prefix_ids, *options, now)
                )
        for worker, batch in batches.values():
            try:
                worker.send.send(("add", batch))
            except OSError:  # it has just ended: its reader fails the jobs it has
                self._fail(worker)
        return await asyncio.gather(*(job.future for job in jobs))

    def _fail(self, worker: _Worker) -> None:
        """Mark an ended worker and fail its outstanding jobs (once)."""
        with self.lock:
            worker.alive = False
            failed, worker.jobs = list(worker.jobs.values()), {}
        code = worker.process.exitcode
        for job in failed:
            job.answer(error=DecodingError(f"the decoding process ended (exit code {code}); try again"))

    async def stop(self) -> None:
        """Let the workers finish the sentences they have, then end them."""
        self.stopping = True
        atexit.unregister(self._exiting)
        for w in self.workers:
            with contextlib.suppress(OSError):  # it has ended already
                w.send.send(("stop",))
        await asyncio.get_running_loop().run_in_executor(None, lambda: [w.process.join() for w in self.workers])

    def _read(self, worker: _Worker) -> None:
        """Answer the worker's jobs as its results come (a thread per worker); a worker
        that ends unasked fails its outstanding jobs and is replaced."""
        while True:
            try:
                kind, results, worker.joins = worker.receive.recv()
            except (EOFError, OSError):
                break
            for job_id, outcome in results:
                with self.lock:
                    job = worker.jobs.pop(job_id, None)
                if job is None:
                    continue
                if kind == "failed":
                    job.answer(error=DecodingError(outcome))
                    continue
                try:
                    job.answer(self.translator.texts(outcome, job.prefix, job.prefix_ids))
                except Exception as e:  # noqa: BLE001 - the request gets the error, the others go on
                    job.answer(error=e)
        worker.process.join(timeout=5)
        self._fail(worker)
        if self.stopping:
            return
        replacement = self._spawn()
        with self.lock:
            self.workers[self.workers.index(worker)] = replacement


def _decode(model, settings: SearchSettings, jobs, results, threads: int, max_batch: int, max_wait: float) -> None:
    """A worker process: receive sentences, decode them continuously, send back each when finished."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the server decides
    torch.set_num_threads(threads)
    keep_freed_memory()
    searches: dict[int, ContinuousBeamSearch] = {}
    waiting: list[tuple[float, int, Sentence]] = []  # (arrived, beam, sentence)
    under_way = joins = 0
    stopping = False

    def receive(timeout: float | None) -> bool:
        """Take one message if one comes within ``timeout`` (None: wait for it). False if none came."""
        nonlocal stopping
        if timeout is not None and not jobs.poll(max(timeout, 0.0)):
            return False
        message = jobs.recv()
        if message[0] == "stop":
            stopping = True
        else:
            for job_id, src, prefix, beam, alpha, n_best, arrived in message[1]:
                waiting.append((arrived, beam, Sentence(src, prefix, alpha, n_best, job_id)))
        return True

    try:
        while True:
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
                    if beam not in searches:
                        searches[beam] = ContinuousBeamSearch(model, settings, beam)
                    searches[beam].add([sentence])
                under_way += len(taken)
                joins += 1
            for beam, search in list(searches.items()):
                if not len(search):
                    continue
                try:
                    done = [(x.tag, [(h.tokens, h.score) for h in hyps]) for x, hyps in search.step()]
                    kind = "done"
                except Exception as e:  # noqa: BLE001 - its sentences fail, the worker goes on
                    done = [(x.tag, f"{type(e).__name__}: {e}") for x in search.sentences + search.waiting]
                    kind = "failed"
                    del searches[beam]
                if done:
                    under_way -= len(done)
                    results.send((kind, done, joins))
    except (EOFError, OSError, KeyboardInterrupt):
        return  # the server has gone

//! `QueueFuture`: a worker's recorded future ([`crate::queue::Future`]) as a Python class,
//! and the plain tuples its settings, cost and KV model arrive as.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::queue::{self, Cost, Kv, Scheduler, Seq, Stretch};

type SettingsArg = (i64, i64, bool, i64);
type CostArg = (f64, f64, f64, f64);
type KvArg = Option<(i64, i64)>;
type StretchArg = (f64, i64, f64, Vec<(i64, i64)>, i64, i64, i64, i64);

fn queue_settings((budget, max_seqs, chunked, cap): SettingsArg) -> queue::Settings {
    queue::Settings {
        budget,
        max_seqs,
        chunked,
        cap,
    }
}

fn queue_cost((a, b, overhead_s, per_seq_s): CostArg) -> Cost {
    Cost {
        a,
        b,
        overhead_s,
        per_seq_s,
    }
}

fn queue_kv(kv: KvArg) -> PyResult<Option<Kv>> {
    match kv {
        None => Ok(None),
        Some((gpu_blocks, block_size)) if gpu_blocks >= 1 && block_size >= 1 => Ok(Some(Kv {
            gpu_blocks,
            block_size,
        })),
        Some(_) => Err(PyValueError::new_err(
            "kv = (gpu_blocks, block_size), both >= 1",
        )),
    }
}

/// A worker's recorded future (the Python reference's `Future`, see `queue.rs`):
/// `settings` = (max_num_batched_tokens, max_num_seqs, chunked_prefill,
/// long_prefill_token_threshold), `cost` = (a, b, step overhead s, decode s per sequence)
/// of `C(N) = N·(a + b·N)`, `kv` = (gpu_blocks, block_size) of the engine's KV model or
/// None.
#[pyclass(module = "foretoken_native", name = "QueueFuture", frozen)]
pub struct QueueFuture {
    future: queue::Future,
}

#[pymethods]
impl QueueFuture {
    /// Replays a queue to its end: `prefilling` = [(computed, end, output tokens left,
    /// order, kv blocks)] in admission order, `decoders` = [(order, step of its last
    /// token, kv blocks)] in admission order, `waiting` = [(computed, end, output tokens
    /// left, kv blocks)] in arrival order, `kv_used` the blocks the running ones reserve.
    #[staticmethod]
    #[pyo3(signature = (settings, cost, kv, free_at_s, steps, next_order, prefilling, decoders, waiting, now_s, tokens_ahead, kv_used))]
    #[allow(clippy::too_many_arguments)]
    fn record(
        settings: SettingsArg,
        cost: CostArg,
        kv: KvArg,
        free_at_s: f64,
        steps: i64,
        next_order: i64,
        prefilling: Vec<(i64, i64, i64, i64, i64)>,
        decoders: Vec<(i64, i64, i64)>,
        waiting: Vec<(i64, i64, i64, i64)>,
        now_s: f64,
        tokens_ahead: i64,
        kv_used: i64,
    ) -> PyResult<Self> {
        let settings = queue_settings(settings);
        if settings.budget < 1 {
            return Err(PyValueError::new_err("max_num_batched_tokens must be >= 1"));
        }
        let kv = queue_kv(kv)?;
        let scheduler = Scheduler {
            settings,
            prefilling: prefilling
                .into_iter()
                .map(|(computed, end, left, order, blocks)| Seq {
                    computed,
                    end,
                    left,
                    order,
                    blocks,
                })
                .collect(),
            dec_orders: decoders.iter().map(|d| d.0).collect(),
            dec_done: decoders.iter().map(|d| d.1).collect(),
            dec_blocks: decoders.iter().map(|d| d.2).collect(),
            waiting: waiting
                .into_iter()
                .map(|(computed, end, left, blocks)| Seq {
                    computed,
                    end,
                    left,
                    order: -1,
                    blocks,
                })
                .collect(),
            free_at_s,
            steps,
            next_order,
            kv_cap: kv.map_or(0, |k| k.gpu_blocks),
            kv_used,
        };
        let future = queue::Future::record(scheduler, now_s, queue_cost(cost), kv, tokens_ahead)
            .map_err(|e| pyo3::exceptions::PyRuntimeError::new_err(e.to_string()))?;
        Ok(Self { future })
    }

    /// A future from recorded stretches [(start_s, steps, per_step_s, chunks, budget_left,
    /// running, waiting, kv_used)] (e.g. the Python reference's).
    #[staticmethod]
    #[pyo3(signature = (settings, cost, kv, ready_s, start_s, stretches, end_s, drained_s, tokens_ahead))]
    #[allow(clippy::too_many_arguments)]
    fn from_stretches(
        settings: SettingsArg,
        cost: CostArg,
        kv: KvArg,
        ready_s: f64,
        start_s: f64,
        stretches: Vec<StretchArg>,
        end_s: f64,
        drained_s: Option<f64>,
        tokens_ahead: i64,
    ) -> PyResult<Self> {
        let stretches = stretches
            .into_iter()
            .map(
                |(start_s, steps, per_step_s, chunks, budget_left, running, waiting, kv_used)| {
                    Stretch {
                        start_s,
                        steps,
                        per_step_s,
                        chunks,
                        budget_left,
                        running,
                        waiting,
                        kv_used,
                    }
                },
            )
            .collect();
        Ok(Self {
            future: queue::Future {
                settings: queue_settings(settings),
                cost: queue_cost(cost),
                kv: queue_kv(kv)?,
                ready_s,
                start_s,
                stretches,
                end_s,
                drained_s,
                tokens_ahead,
            },
        })
    }

    /// `(queue_wait_s, prefill_s, ttft_s, steps, queue_tokens_ahead)` of a new request
    /// arriving at `now_s` behind the queue.
    fn first_token(
        &self,
        prompt_tokens: i64,
        cached_tokens: i64,
        pinned_tokens: i64,
        output_tokens: i64,
        now_s: f64,
    ) -> (f64, f64, f64, i64, i64) {
        let p = self.future.first_token(
            prompt_tokens,
            cached_tokens,
            pinned_tokens,
            output_tokens,
            now_s,
        );
        (
            p.queue_wait_s,
            p.prefill_s,
            p.ttft_s,
            p.steps,
            p.queue_tokens_ahead,
        )
    }

    fn drain_s(&self, now_s: f64) -> f64 {
        self.future.drain_s(now_s)
    }

    /// The stretches, in the layout `from_stretches` takes.
    fn stretches(&self) -> Vec<StretchArg> {
        self.future
            .stretches
            .iter()
            .map(|s| {
                (
                    s.start_s,
                    s.steps,
                    s.per_step_s,
                    s.chunks.clone(),
                    s.budget_left,
                    s.running,
                    s.waiting,
                    s.kv_used,
                )
            })
            .collect()
    }

    #[getter]
    fn ready_s(&self) -> f64 {
        self.future.ready_s
    }

    #[getter]
    fn start_s(&self) -> f64 {
        self.future.start_s
    }

    #[getter]
    fn end_s(&self) -> f64 {
        self.future.end_s
    }

    #[getter]
    fn drained_s(&self) -> Option<f64> {
        self.future.drained_s
    }

    #[getter]
    fn tokens_ahead(&self) -> i64 {
        self.future.tokens_ahead
    }
}

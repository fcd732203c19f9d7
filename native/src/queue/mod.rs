//! A worker's recorded future and a new request's first token read off it: a port of the
//! Python reference (`foretoken/core/queue/future.py` `Future.record` / `first_token`, and
//! the step scheduler of `foretoken/core/queue/scheduler.py` it replays), computing the
//! same floating-point operations in the same order, so both give bit-identical results
//! (`tests/unit/core/queue/test_native_walk.py` checks it on random queues).
//!
//! The cost of a step is the reference's `CurveStepCost` over a prefill curve
//! `C(N) = N·(a + b·N)` (`PrefillCurve.cost_s`): `overhead + decoders·per_seq +
//! Σ C(end) − C(start)` over the step's chunks. Only that cost is ported: another cost
//! model stays on the Python walk, which remains the reference and the seam.
//!
//! By role: this module holds what the replay and the future share (the cost, settings,
//! KV model and stretch values, the error); [`replay`] the step scheduler that replays a
//! queue ([`Scheduler`]); [`future`] the recorded [`Future`] and a new request's walk
//! through it.

mod future;
mod replay;

pub use future::{prefill_span, Future, Prediction};
pub use replay::{Scheduler, Seq};

/// The step cost: prefill curve `C(N) = N·(a + b·N)` seconds, step overhead, per-sequence
/// decode time.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Cost {
    pub a: f64,
    pub b: f64,
    pub overhead_s: f64,
    pub per_seq_s: f64,
}

impl Cost {
    #[inline]
    pub fn prefill_s(&self, n: i64) -> f64 {
        let n = n as f64;
        n * (self.a + self.b * n)
    }

    /// Prefill time of prompt tokens `start..end`: `C(end) − C(start)`.
    #[inline]
    pub fn chunk_s(&self, start: i64, end: i64) -> f64 {
        self.prefill_s(end) - self.prefill_s(start)
    }
}

/// The engine's scheduler settings (the reference's `SchedulerSettings`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Settings {
    pub budget: i64,
    pub max_seqs: i64,
    pub chunked: bool,
    /// `long_prefill_token_threshold` (0: no cap).
    pub cap: i64,
}

/// The engine's KV capacity (the reference's `KvModel`): an admitted sequence reserves its
/// blocks, and the head of the waiting queue waits until its blocks fit (a sequence alone
/// on the engine always starts).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Kv {
    pub gpu_blocks: i64,
    pub block_size: i64,
}

impl Kv {
    /// `ceil((prompt + output − 1) / block_size)` less the cached prefix's whole blocks,
    /// within `1..=gpu_blocks` (the reference's `KvModel.blocks`).
    pub fn blocks(&self, prompt_tokens: i64, cached_tokens: i64, output_tokens: i64) -> i64 {
        let mut total = ceil_div(prompt_tokens + output_tokens.max(1) - 1, self.block_size);
        total -= cached_tokens.max(0).div_euclid(self.block_size);
        total.min(self.gpu_blocks).max(1)
    }
}

impl Settings {
    /// The cap as the scheduler uses it (none for a serial engine).
    fn effective_cap(&self) -> i64 {
        if self.chunked {
            self.cap
        } else {
            0
        }
    }
}

/// `steps` identical engine steps from `start_s` (the reference's `Stretch`).
#[derive(Clone, Debug, PartialEq)]
pub struct Stretch {
    pub start_s: f64,
    pub steps: i64,
    pub per_step_s: f64,
    /// (tokens computed before the stretch, tokens per step) of each partial prefill.
    pub chunks: Vec<(i64, i64)>,
    pub budget_left: i64,
    pub running: i64,
    pub waiting: i64,
    /// KV blocks the running sequences reserve (0 without a KV model).
    pub kv_used: i64,
}

impl Stretch {
    /// When the stretch's `j`-th step (1-based) ends.
    pub fn end_of_step_s(&self, j: i64, cost: &Cost) -> f64 {
        let mut total_s = self.start_s + j as f64 * self.per_step_s;
        for &(computed, size) in &self.chunks {
            total_s += cost.chunk_s(computed, computed + j * size);
        }
        total_s
    }
}

/// What a replay cannot do (the reference raises `RuntimeError` / `ValueError`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum QueueError {
    Unbounded,
    Stalled,
}

impl std::fmt::Display for QueueError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            QueueError::Unbounded => write!(f, "an unbounded stretch needs a time bound"),
            QueueError::Stalled => write!(f, "the replay stalled before the queue drained"),
        }
    }
}

impl std::error::Error for QueueError {}

/// `-(-x // y)`: ceiling division as Python computes it (y > 0).
fn ceil_div(x: i64, y: i64) -> i64 {
    -(-x).div_euclid(y)
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;

    use super::*;

    fn cost() -> Cost {
        Cost {
            a: 1.5e-4,
            b: 2.5e-9,
            overhead_s: 0.004,
            per_seq_s: 1e-4,
        }
    }

    fn settings(chunked: bool) -> Settings {
        Settings {
            budget: 8192,
            max_seqs: 256,
            chunked,
            cap: 0,
        }
    }

    fn empty(chunked: bool) -> Scheduler {
        Scheduler {
            settings: settings(chunked),
            prefilling: Vec::new(),
            dec_orders: Vec::new(),
            dec_done: Vec::new(),
            dec_blocks: Vec::new(),
            waiting: VecDeque::new(),
            free_at_s: 10.0,
            steps: 0,
            next_order: 0,
            kv_cap: 0,
            kv_used: 0,
        }
    }

    fn prompt(end: i64, left: i64, blocks: i64) -> Seq {
        Seq {
            computed: 0,
            end,
            left,
            order: -1,
            blocks,
        }
    }

    #[test]
    fn an_idle_engine_prefills_alone_in_budget_sized_chunks() {
        let future = Future::record(empty(true), 12.0, cost(), None, 0).unwrap();
        assert!(future.stretches.is_empty());
        let p = future.first_token(20_000, 0, -1, 1, 12.0);
        let c = cost();
        assert_eq!(p.steps, 3); // ceil(20000 / 8192)
        assert_eq!(
            p.ttft_s,
            12.0 + 3.0 * c.overhead_s + c.chunk_s(0, 20_000) - 12.0
        );
        assert_eq!(p.queue_wait_s, p.ttft_s - p.prefill_s);
    }

    #[test]
    fn a_queued_prompt_goes_first_and_its_stretch_is_recorded() {
        let mut s = empty(true);
        s.waiting.push_back(prompt(16_384, 3, 0));
        let future = Future::record(s, 10.0, cost(), None, 16_384).unwrap();
        // admitted alone (1 step), then a stretch of 1 step completing it, then decoding
        assert_eq!(future.stretches[0].steps, 1);
        assert_eq!(future.stretches[0].chunks, vec![(0, 8192)]);
        assert!(future.drained_s.is_some());
        let alone = Future::record(empty(true), 10.0, cost(), None, 0).unwrap();
        let behind = future.first_token(1000, 0, -1, 1, 10.0);
        assert!(behind.ttft_s > alone.first_token(1000, 0, -1, 1, 10.0).ttft_s);
        assert_eq!(behind.queue_tokens_ahead, 16_384);
    }

    #[test]
    fn a_head_whose_blocks_do_not_fit_waits_until_they_are_freed() {
        let kv = Kv {
            gpu_blocks: 100,
            block_size: 16,
        };
        let mut s = empty(true);
        s.kv_cap = kv.gpu_blocks;
        s.waiting.push_back(prompt(1000, 200, 80)); // 80 of 100 blocks
        s.waiting.push_back(prompt(100, 2, 30)); // does not fit beside it
        let future = Future::record(s, 10.0, cost(), Some(kv), 1100).unwrap();
        let first = &future.stretches[0];
        assert_eq!((first.running, first.waiting, first.kv_used), (1, 1, 80));
        // the second starts only once the first has left (200 output tokens later)
        let second_admitted = future
            .stretches
            .iter()
            .position(|st| st.waiting == 0)
            .expect("admitted at last");
        assert!(
            future.stretches[..second_admitted]
                .iter()
                .map(|st| st.steps)
                .sum::<i64>()
                >= 200
        );
        // a new request needing more than what is left waits too; a small one does not
        let big = future.first_token(8000, 0, -1, 1, 10.0); // 100 blocks: waits for an empty engine
        let small = future.first_token(16, 0, -1, 1, 10.0);
        assert!(big.steps > small.steps);
        // a 3,200-token cached prefix (200 blocks, capped at 100) held by a running
        // sequence costs nothing; held by nobody, it is charged and waits like `big`
        let pinned = future.first_token(3216, 3200, -1, 1, 10.0);
        let unheld = future.first_token(3216, 3200, 0, 1, 10.0);
        assert_eq!(pinned.steps, small.steps);
        assert_eq!(unheld.steps, big.steps);
        assert_eq!(kv.blocks(800, 0, 1), 50);
        assert_eq!(kv.blocks(16, 0, 1), 1);
        assert_eq!(kv.blocks(10_000, 0, 1), 100); // at most the engine's blocks
        assert_eq!(kv.blocks(32, 32, 1), 1); // at least one
    }

    #[test]
    fn ceil_div_is_pythons() {
        assert_eq!(ceil_div(7, 2), 4);
        assert_eq!(ceil_div(8, 2), 4);
        assert_eq!(ceil_div(1, 8192), 1);
    }
}

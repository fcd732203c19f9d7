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

use std::collections::VecDeque;

/// A run length with no bound from the sequences.
const UNBOUNDED: i64 = 1 << 62;

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

/// A sequence inside a replay.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Seq {
    pub computed: i64,
    pub end: i64,
    /// Output tokens left (its first token included while it prefills).
    pub left: i64,
    /// Admission order once running.
    pub order: i64,
    /// KV blocks it reserves while running (0 without a KV model).
    pub blocks: i64,
}

/// The step scheduler replaying a queue's future (the reference's `_Scheduler` with
/// `retire=True`, run without a time bound).
#[derive(Clone, Debug)]
pub struct Scheduler {
    pub settings: Settings,
    pub prefilling: Vec<Seq>,
    /// Decoders in admission order, and the step at whose end each emits its last token.
    pub dec_orders: Vec<i64>,
    pub dec_done: Vec<i64>,
    /// The KV blocks of each decoder (parallel to `dec_orders`).
    pub dec_blocks: Vec<i64>,
    pub waiting: VecDeque<Seq>,
    pub free_at_s: f64,
    pub steps: i64,
    pub next_order: i64,
    /// The engine's KV blocks (0: no KV model) and those the running sequences reserve.
    pub kv_cap: i64,
    pub kv_used: i64,
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

fn bisect_left(sorted: &[i64], x: i64) -> usize {
    sorted.partition_point(|&v| v < x)
}

impl Scheduler {
    fn has_prefill(&self) -> bool {
        !self.waiting.is_empty() || !self.prefilling.is_empty()
    }

    fn clamp(&self, size: i64, budget: i64) -> i64 {
        let cap = self.settings.effective_cap();
        let size = if 0 < cap && cap < size { cap } else { size };
        if budget < size {
            budget
        } else {
            size
        }
    }

    /// One step: chunk sizes of the first `sizes.len()` partial prefills (admissions
    /// appended), how many of the first decoders decode, and whether anyone was admitted.
    fn plan(&mut self, sizes: &mut Vec<i64>) -> (i64, bool) {
        let mut budget = self.settings.budget;
        let (mut decoders, mut passed) = (0i64, 0i64);
        for seq in &self.prefilling {
            let before = bisect_left(&self.dec_orders, seq.order) as i64;
            let take = if before - passed < budget {
                before - passed
            } else {
                budget
            };
            decoders += take;
            budget -= take;
            passed = before;
            if budget <= 0 {
                return (decoders, false);
            }
            let mut size = seq.end - seq.computed;
            if self.settings.chunked {
                size = self.clamp(size, budget);
            }
            sizes.push(size);
            budget -= size;
            if budget <= 0 {
                return (decoders, false);
            }
        }
        let take = (self.dec_orders.len() as i64 - passed).min(budget);
        let admitted = self.admit(budget - take, sizes);
        (decoders + take, admitted)
    }

    fn admit(&mut self, mut budget: i64, sizes: &mut Vec<i64>) -> bool {
        let mut running = (self.prefilling.len() + self.dec_orders.len()) as i64;
        let mut admitted = false;
        let (mut kv_used, kv_cap) = (self.kv_used, self.kv_cap);
        while budget > 0 && running < self.settings.max_seqs {
            let Some(&head) = self.waiting.front() else {
                break;
            };
            if kv_used != 0 && kv_used + head.blocks > kv_cap {
                break; // its KV blocks do not fit: it waits, and everyone behind it
            }
            let mut size = head.end - head.computed;
            if self.settings.chunked {
                size = self.clamp(size, budget);
            } else if size > budget && (size <= self.settings.budget || !sizes.is_empty()) {
                break; // serial: the head waits until it fits, and everyone behind it
            }
            let mut seq = self.waiting.pop_front().expect("a head");
            seq.order = self.next_order;
            self.next_order += 1;
            kv_used += seq.blocks;
            self.prefilling.push(seq);
            sizes.push(size);
            budget -= size;
            running += 1;
            admitted = true;
        }
        self.kv_used = kv_used;
        admitted
    }

    fn run_length(&self, sizes: &[i64], decoders: i64) -> i64 {
        let mut steps = UNBOUNDED;
        for (seq, &size) in self.prefilling.iter().zip(sizes) {
            let repeats = (seq.end - seq.computed).div_euclid(size);
            steps = steps.min(repeats);
        }
        if decoders > 0 {
            let last = self.dec_done[..decoders as usize]
                .iter()
                .copied()
                .min()
                .expect("decoders");
            steps = steps.min(last - self.steps);
        }
        steps
    }

    fn prefill_s(&self, sizes: &[i64], steps: i64, cost: &Cost) -> f64 {
        let mut total_s = 0.0;
        for (seq, &size) in self.prefilling.iter().zip(sizes) {
            total_s += cost.chunk_s(seq.computed, seq.computed + steps * size);
        }
        total_s
    }

    /// Runs the next step and every identical one after it; None when nothing is left.
    pub fn run_stretch(&mut self, cost: &Cost) -> Result<Option<Stretch>, QueueError> {
        let start_s = self.free_at_s;
        let mut sizes = Vec::new();
        let (decoders, admitted) = self.plan(&mut sizes);
        if sizes.is_empty() && decoders == 0 {
            return Ok(None);
        }
        let per_step_s = cost.overhead_s + decoders as f64 * cost.per_seq_s;
        let steps = if admitted {
            1
        } else {
            self.run_length(&sizes, decoders)
        };
        if steps >= UNBOUNDED {
            return Err(QueueError::Unbounded);
        }
        self.free_at_s = start_s + steps as f64 * per_step_s + self.prefill_s(&sizes, steps, cost);
        let chunks = self
            .prefilling
            .iter()
            .zip(&sizes)
            .map(|(seq, &size)| (seq.computed, size))
            .collect();
        let used: i64 = sizes.iter().sum();
        let stretch = Stretch {
            start_s,
            steps,
            per_step_s,
            chunks,
            budget_left: self.settings.budget - decoders - used,
            running: (self.prefilling.len() + self.dec_orders.len()) as i64,
            waiting: self.waiting.len() as i64,
            kv_used: self.kv_used,
        };
        self.advance(&sizes, decoders, steps);
        Ok(Some(stretch))
    }

    fn advance(&mut self, sizes: &[i64], decoders: i64, steps: i64) {
        self.steps += steps;
        let reached = decoders as usize;
        if reached < self.dec_done.len() {
            for d in &mut self.dec_done[reached..] {
                *d += steps; // the ones the budget did not reach wait as long
            }
        }
        if self.dec_done.iter().any(|&d| d <= self.steps) {
            self.retire_decoders();
        }
        let mut completed = false;
        for (seq, &size) in self.prefilling.iter_mut().zip(sizes) {
            seq.computed += steps * size;
            completed = completed || seq.computed >= seq.end;
        }
        if completed {
            let old = std::mem::take(&mut self.prefilling);
            self.prefilling = old.iter().copied().filter(|s| s.computed < s.end).collect();
            for seq in &old[..sizes.len()] {
                if seq.computed >= seq.end {
                    self.first_token(*seq);
                }
            }
        }
    }

    fn first_token(&mut self, mut seq: Seq) {
        seq.left -= 1;
        if seq.left > 0 {
            let at = bisect_left(&self.dec_orders, seq.order);
            self.dec_orders.insert(at, seq.order);
            self.dec_done.insert(at, self.steps + seq.left);
            self.dec_blocks.insert(at, seq.blocks);
        } else {
            self.kv_used -= seq.blocks; // it leaves: its blocks are free
        }
    }

    fn retire_decoders(&mut self) {
        let now = self.steps;
        let mut kept_orders = Vec::with_capacity(self.dec_orders.len());
        let mut kept_done = Vec::with_capacity(self.dec_done.len());
        let mut kept_blocks = Vec::with_capacity(self.dec_blocks.len());
        let mut freed = 0;
        for ((&order, &done), &blocks) in self
            .dec_orders
            .iter()
            .zip(&self.dec_done)
            .zip(&self.dec_blocks)
        {
            if done > now {
                kept_orders.push(order);
                kept_done.push(done);
                kept_blocks.push(blocks);
            } else {
                freed += blocks;
            }
        }
        self.kv_used -= freed;
        self.dec_orders = kept_orders;
        self.dec_done = kept_done;
        self.dec_blocks = kept_blocks;
    }
}

/// A new request's prediction (the reference's `QueuePrediction`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Prediction {
    pub queue_wait_s: f64,
    pub prefill_s: f64,
    pub ttft_s: f64,
    pub steps: i64,
    pub queue_tokens_ahead: i64,
}

/// The queue's steps from `start_s` until it is empty, with no new request.
#[derive(Clone, Debug, PartialEq)]
pub struct Future {
    pub settings: Settings,
    pub cost: Cost,
    /// The KV model the queue was replayed with (None: admission never waits for blocks).
    pub kv: Option<Kv>,
    pub ready_s: f64,
    pub start_s: f64,
    pub stretches: Vec<Stretch>,
    pub end_s: f64,
    pub drained_s: Option<f64>,
    pub tokens_ahead: i64,
}

/// (first token to compute, prompt length): at least one token is always computed.
pub fn prefill_span(prompt_tokens: i64, cached_tokens: i64) -> (i64, i64) {
    let prompt = prompt_tokens.max(1);
    (cached_tokens.max(0).min(prompt - 1), prompt)
}

/// `-(-x // y)`: ceiling division as Python computes it (y > 0).
fn ceil_div(x: i64, y: i64) -> i64 {
    -(-x).div_euclid(y)
}

impl Future {
    /// Runs `scheduler` (a replay of the future) to its end from `now_s` (or the end of
    /// its current step) and keeps what it did.
    pub fn record(
        mut scheduler: Scheduler,
        now_s: f64,
        cost: Cost,
        kv: Option<Kv>,
        tokens_ahead: i64,
    ) -> Result<Future, QueueError> {
        let ready_s = scheduler.free_at_s;
        let begin_s = if now_s > ready_s { now_s } else { ready_s };
        scheduler.free_at_s = begin_s;
        let mut stretches = Vec::new();
        let had_prefill = scheduler.has_prefill();
        let mut drained_s = None;
        while let Some(stretch) = scheduler.run_stretch(&cost)? {
            stretches.push(stretch);
            if had_prefill && drained_s.is_none() && !scheduler.has_prefill() {
                drained_s = Some(scheduler.free_at_s);
            }
        }
        if had_prefill && drained_s.is_none() {
            return Err(QueueError::Stalled);
        }
        Ok(Future {
            settings: scheduler.settings,
            cost,
            kv,
            ready_s,
            start_s: begin_s,
            stretches,
            end_s: scheduler.free_at_s,
            drained_s,
            tokens_ahead,
        })
    }

    /// A replay of the future does not depend on the clock: from a later start everything
    /// happens that much later.
    fn offset(&self, now_s: f64) -> f64 {
        let from = if now_s > self.ready_s {
            now_s
        } else {
            self.ready_s
        };
        from - self.start_s
    }

    /// Seconds from `now_s` until every prompt in the queue is prefilled.
    pub fn drain_s(&self, now_s: f64) -> f64 {
        match self.drained_s {
            None => 0.0,
            Some(drained_s) => drained_s + self.offset(now_s) - now_s,
        }
    }

    /// What the full replay gives for a new request arriving at `now_s` behind this queue
    /// (the reference's `Future.first_token`).
    pub fn first_token(
        &self,
        prompt_tokens: i64,
        cached_tokens: i64,
        output_tokens: i64,
        now_s: f64,
    ) -> Prediction {
        let (settings, cost) = (&self.settings, &self.cost);
        let (first, prompt) = prefill_span(prompt_tokens, cached_tokens);
        let (blocks, kv_cap) = match self.kv {
            Some(kv) => (kv.blocks(prompt, first, output_tokens), kv.gpu_blocks),
            None => (0, 0),
        };
        let chunked = settings.chunked;
        let cap = settings.effective_cap();
        let (budget, max_seqs) = (settings.budget, settings.max_seqs);
        let (mut computed, mut admitted, mut shift_s, mut steps) = (first, false, 0.0, 0i64);
        let mut done_s = None;
        for st in &self.stretches {
            let left = st.budget_left;
            let blocked = st.running >= max_seqs
                || st.waiting != 0
                || (st.kv_used + blocks > kv_cap && kv_cap > 0);
            if left <= 0 || (!admitted && blocked) {
                steps += st.steps;
                continue;
            }
            if !chunked {
                // serial: the whole prompt in one step, when it may start
                let size = prompt - computed;
                if size > left && (size <= budget || !st.chunks.is_empty()) {
                    steps += st.steps;
                    continue;
                }
                done_s = Some(st.end_of_step_s(1, cost) + shift_s + cost.chunk_s(computed, prompt));
                steps += 1;
                break;
            }
            admitted = true;
            let per = if 0 < cap && cap < left { cap } else { left };
            let need = ceil_div(prompt - computed, per);
            if need <= st.steps {
                done_s =
                    Some(st.end_of_step_s(need, cost) + shift_s + cost.chunk_s(computed, prompt));
                steps += need;
                break;
            }
            shift_s += cost.chunk_s(computed, computed + st.steps * per);
            computed += st.steps * per;
            steps += st.steps;
        }
        let done_s = match done_s {
            Some(d) => d,
            None => {
                // alone on the engine after the queue
                let per = if !chunked {
                    prompt - computed
                } else {
                    let c = if cap != 0 { cap } else { budget };
                    c.min(budget)
                };
                let need = ceil_div(prompt - computed, per);
                let mut d = self.end_s + shift_s + need as f64 * cost.overhead_s;
                d += cost.chunk_s(computed, prompt);
                steps += need;
                d
            }
        };
        let ttft_s = done_s + self.offset(now_s) - now_s;
        let prefill_s = cost.chunk_s(first, prompt);
        let wait = ttft_s - prefill_s;
        Prediction {
            queue_wait_s: if 0.0 > wait { 0.0 } else { wait },
            prefill_s,
            ttft_s,
            steps,
            queue_tokens_ahead: self.tokens_ahead,
        }
    }
}

#[cfg(test)]
mod tests {
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
        let p = future.first_token(20_000, 0, 1, 12.0);
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
        let behind = future.first_token(1000, 0, 1, 10.0);
        assert!(behind.ttft_s > alone.first_token(1000, 0, 1, 10.0).ttft_s);
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
        let big = future.first_token(8000, 0, 1, 10.0); // 100 blocks: waits for an empty engine
        let small = future.first_token(16, 0, 1, 10.0);
        assert!(big.steps > small.steps);
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

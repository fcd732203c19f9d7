//! The step scheduler replaying a queue's future (the reference's `_Scheduler` of
//! `foretoken/core/queue/scheduler.py`): one stretch of identical steps at a time.

use std::collections::VecDeque;

use super::{Cost, QueueError, Settings, Stretch};

/// A run length with no bound from the sequences.
const UNBOUNDED: i64 = 1 << 62;

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

fn bisect_left(sorted: &[i64], x: i64) -> usize {
    sorted.partition_point(|&v| v < x)
}

impl Scheduler {
    pub(super) fn has_prefill(&self) -> bool {
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

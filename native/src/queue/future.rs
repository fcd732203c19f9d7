//! The queue's recorded future (the reference's `Future` of
//! `foretoken/core/queue/future.py`): the replay kept, and a new request's first token
//! read off it.

use super::{ceil_div, Cost, Kv, QueueError, Scheduler, Settings, Stretch};

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
    /// (the reference's `Future.first_token`); `pinned_tokens` of its cached prefix are held
    /// by another sequence (negative: all of them), the rest are charged as KV blocks.
    pub fn first_token(
        &self,
        prompt_tokens: i64,
        cached_tokens: i64,
        pinned_tokens: i64,
        output_tokens: i64,
        now_s: f64,
    ) -> Prediction {
        let (settings, cost) = (&self.settings, &self.cost);
        let (first, prompt) = prefill_span(prompt_tokens, cached_tokens);
        let pinned = if pinned_tokens < 0 {
            first
        } else {
            pinned_tokens.min(first)
        };
        let (blocks, kv_cap) = match self.kv {
            Some(kv) => (kv.blocks(prompt, pinned, output_tokens), kv.gpu_blocks),
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

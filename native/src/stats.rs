//! What one `apply` did, and summed, what the index did since it started. The field names
//! and their order are those of the Python reference's `ApplyStats`.

macro_rules! apply_stats {
    ($($field:ident),* $(,)?) => {
        #[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
        pub struct ApplyStats {
            $(pub $field: u64,)*
        }

        impl ApplyStats {
            /// The field names, in order.
            pub const FIELDS: &'static [&'static str] = &[$(stringify!($field)),*];

            /// The values, in the order of [`ApplyStats::FIELDS`].
            pub fn values(&self) -> Vec<u64> {
                vec![$(self.$field),*]
            }

            pub fn from_values(values: &[u64]) -> Option<Self> {
                let mut it = values.iter().copied();
                let stats = Self { $($field: it.next()?,)* };
                it.next().is_none().then_some(stats)
            }

            pub fn add(&mut self, other: &ApplyStats) {
                $(self.$field += other.$field;)*
            }
        }
    };
}

apply_stats!(
    batches,
    stored_blocks,
    removed_blocks,
    duplicate_stores,
    unknown_parents,
    unknown_removals,
    absent_removals,
    unknown_moves,
    remapped_blocks,
    ignored_blocks,
    block_size_mismatch_blocks,
    malformed_blocks,
    clears,
    resets,
    expired_blocks,
    trimmed_blocks,
    unknown_worker_batches,
    model_mismatch_batches,
    // the cross-tier rule: stores whose parent, and blocks of stores without token ids
    // (tier moves) whose engine hash, was found among the recently removed blocks
    recovered_parents,
    recovered_moves,
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_round_trip_in_field_order() {
        let stats = ApplyStats {
            batches: 1,
            model_mismatch_batches: 7,
            ..Default::default()
        };
        let values = stats.values();
        assert_eq!(values.len(), ApplyStats::FIELDS.len());
        assert_eq!(ApplyStats::FIELDS[0], "batches");
        assert_eq!(values[ApplyStats::FIELDS.len() - 3], 7);
        assert_eq!(ApplyStats::from_values(&values), Some(stats));
        assert_eq!(ApplyStats::from_values(&values[1..]), None);
    }
}

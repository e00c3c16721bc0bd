//! Bounds both programs rely on: the node enforces them, the controller sizes its buffers by
//! them.

/// The highest `limits.max_screendump_bytes` accepted: the controller decodes replies up to
/// this plus room for the other fields.
pub const MAX_SCREENDUMP_BYTES: usize = 32 * 1024 * 1024;

/// How many records one run's journal holds by default (`limits.max_journal_records`).
pub const DEFAULT_MAX_JOURNAL_RECORDS: usize = 10_000;

/// How many bytes one run's journal holds by default (`limits.max_journal_bytes`).
pub const DEFAULT_MAX_JOURNAL_BYTES: u64 = 16 * 1024 * 1024;

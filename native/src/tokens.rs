//! The built-in tokenizer's ids for ASCII text (`foretoken/core/tokenizer.py`, whose Python
//! code is the reference and handles every other text).
//!
//! A piece is a run of whitespace (ASCII `\t \n \x0b \x0c \r` and space, and `\x1c`–`\x1f`,
//! which Python's `str` pattern counts as whitespace too) followed by either a run of word
//! bytes (`[A-Za-z0-9_]`) or one other byte; whitespace with nothing after it is no piece.
//! A piece's id is `RESERVED + xxh3_64(piece) mod (vocab − RESERVED)`.

use xxhash_rust::xxh3::xxh3_64;

/// Ids below this are never produced for text.
pub const RESERVED: u32 = 16;

#[inline]
fn is_space(b: u8) -> bool {
    matches!(b, b'\t' | b'\n' | 0x0b | 0x0c | b'\r' | b' ' | 0x1c..=0x1f)
}

#[inline]
fn is_word(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_'
}

/// The token ids of ASCII `text` for a vocabulary of `vocab` ids (`vocab > RESERVED`).
/// Bytes above 0x7f are taken as "other" bytes, one piece each: the caller passes ASCII.
pub fn sim_token_ids(text: &[u8], vocab: u32) -> Vec<u32> {
    debug_assert!(vocab > RESERVED);
    let span = u64::from(vocab - RESERVED);
    let mut ids = Vec::with_capacity(text.len() / 4 + 1);
    let n = text.len();
    let mut i = 0;
    while i < n {
        let start = i;
        while i < n && is_space(text[i]) {
            i += 1;
        }
        if i == n {
            break; // trailing whitespace is no piece
        }
        if is_word(text[i]) {
            while i < n && is_word(text[i]) {
                i += 1;
            }
        } else {
            i += 1;
        }
        // the remainder is below `span` < 2^32, so the cast keeps every bit
        let id = (xxh3_64(&text[start..i]) % span) as u32 + RESERVED;
        ids.push(id);
    }
    ids
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(piece: &str, vocab: u32) -> u32 {
        (xxh3_64(piece.as_bytes()) % u64::from(vocab - RESERVED)) as u32 + RESERVED
    }

    #[test]
    fn pieces_are_whitespace_then_a_word_or_one_other_byte() {
        let v = 32_000;
        let got = sim_token_ids(b"Hello,  world_1 !?\n\x1cx  ", v);
        let want: Vec<u32> = ["Hello", ",", "  world_1", " !", "?", "\n\x1cx"]
            .iter()
            .map(|p| id(p, v))
            .collect();
        assert_eq!(got, want);
    }

    #[test]
    fn empty_and_blank_text_have_no_pieces() {
        assert!(sim_token_ids(b"", 100).is_empty());
        assert!(sim_token_ids(b" \t\n\x1f", 100).is_empty());
    }
}

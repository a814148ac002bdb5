//! Percent-decoding (`%40` for `@`), for the parts of a connection URL that may carry any
//! character: a user name, a password, a host or socket directory. Both backends' URLs need it
//! (`postgres/conninfo`, `redis/url.rs`), so it lives once, in a leaf below both; each caller
//! turns a [`PercentError`] into its own error, in its own words.

/// Why a text does not percent-decode.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PercentError {
    /// A `%` not followed by two hexadecimal digits.
    InvalidEscape,
    /// The decoded bytes are not UTF-8.
    NotUtf8,
}

/// What a `%` too near the end of the text to have two digits after it means ("50%").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CutShort {
    /// An invalid escape, as libpq reads a PostgreSQL URL.
    Refuse,
    /// The characters themselves, as pgleader has always read a Redis URL's user and password
    /// (a password may end in `%`).
    Keep,
}

/// Decodes every `%XX` in `text`.
pub fn decode(text: &str, cut_short: CutShort) -> Result<String, PercentError> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let kept = cut_short == CutShort::Keep && i + 3 > bytes.len();
        if bytes[i] == b'%' && !kept {
            let hex = bytes
                .get(i + 1..i + 3)
                .and_then(|hex| std::str::from_utf8(hex).ok())
                .and_then(|hex| u8::from_str_radix(hex, 16).ok())
                .ok_or(PercentError::InvalidEscape)?;
            out.push(hex);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| PercentError::NotUtf8)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decodes_escapes_and_refuses_or_keeps_a_cut_short_one() {
        for cut_short in [CutShort::Refuse, CutShort::Keep] {
            assert_eq!(decode("s%40cret", cut_short), Ok("s@cret".into()));
            assert_eq!(decode("a%zzb", cut_short), Err(PercentError::InvalidEscape));
            assert_eq!(decode("%ff", cut_short), Err(PercentError::NotUtf8));
        }
        assert_eq!(
            decode("50%", CutShort::Refuse),
            Err(PercentError::InvalidEscape)
        );
        assert_eq!(
            decode("50%4", CutShort::Refuse),
            Err(PercentError::InvalidEscape)
        );
        assert_eq!(decode("50%", CutShort::Keep), Ok("50%".into()));
        assert_eq!(decode("50%4", CutShort::Keep), Ok("50%4".into()));
    }
}

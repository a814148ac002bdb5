//! The advisory-lock key: `--lock-id` and `--lock NAME` both end up as one signed 64-bit key,
//! the argument of `pg_advisory_lock(bigint)`.
//!
//! A name is hashed the way PostgreSQL's `hashtextextended(name, 0)` hashes it, so an operator can
//! find the key of a named lock in SQL without pgleader. The hash is PostgreSQL's
//! `hash_bytes_extended` (Bob Jenkins' lookup3), computed here so that pgleader knows the key
//! before it has a connection; a test checks it against a real server.
//!
//! A bigint key shows in `pg_locks` split in two: `classid` holds the high 32 bits, `objid` the
//! low 32 bits, and `objsubid` is 1 (the two-int4 form uses 2). Checking `objid` alone would be
//! wrong for keys at or above 2^32 and for negative keys.

use std::fmt;

/// The key pgleader locks, with the name it came from when `--lock NAME` was used.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LockKey {
    key: i64,
    name: Option<String>,
}

impl LockKey {
    /// The key a crontab job's ledger rows are kept under, in the fleet of this lock: the
    /// fleet's key and the job's name, apart by a character no name holds (U+001F).
    pub fn of_job(&self, job: &str) -> LockKey {
        LockKey::from_name(&format!("{}\u{1f}{job}", self.key()))
    }

    /// A key given as a number (`--lock-id`).
    pub fn from_id(key: i64) -> Self {
        LockKey { key, name: None }
    }

    /// A key derived from a name (`--lock`), equal to `SELECT hashtextextended(name, 0)` on a
    /// UTF-8 database.
    pub fn from_name(name: &str) -> Self {
        LockKey {
            key: hash_text_extended(name.as_bytes()) as i64,
            name: Some(name.to_owned()),
        }
    }

    /// The signed 64-bit key, as `pg_advisory_lock(bigint)` takes it.
    pub fn key(&self) -> i64 {
        self.key
    }

    /// The name the key was derived from, if any.
    pub fn name(&self) -> Option<&str> {
        self.name.as_deref()
    }

    /// The high 32 bits of the key: `pg_locks.classid`.
    pub fn classid(&self) -> u32 {
        ((self.key as u64) >> 32) as u32
    }

    /// The low 32 bits of the key: `pg_locks.objid`.
    pub fn objid(&self) -> u32 {
        self.key as u64 as u32
    }
}

impl fmt::Display for LockKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.name {
            Some(name) => write!(f, "{name:?} (key {})", self.key),
            None => write!(f, "{}", self.key),
        }
    }
}

/// PostgreSQL's `hash_bytes_extended(k, len, 0)` as a little-endian server computes it, which is
/// what `hashtextextended(text, 0)` returns. (A big-endian server reads the words the other way
/// round and gets other values; PostgreSQL runs on little-endian machines almost everywhere.)
fn hash_text_extended(bytes: &[u8]) -> u64 {
    let initial = 0x9e37_79b9_u32
        .wrapping_add(bytes.len() as u32)
        .wrapping_add(3_923_095);
    let (mut a, mut b, mut c) = (initial, initial, initial);

    let mut chunks = bytes.chunks_exact(12);
    for chunk in &mut chunks {
        a = a.wrapping_add(word_le(&chunk[0..4]));
        b = b.wrapping_add(word_le(&chunk[4..8]));
        c = c.wrapping_add(word_le(&chunk[8..12]));
        mix(&mut a, &mut b, &mut c);
    }

    // The last 0..=11 bytes fill a, then b, then the upper three bytes of c: the lowest byte of
    // c is reserved for the length, which is already part of the initial state.
    let tail = chunks.remainder();
    for (i, &byte) in tail.iter().enumerate() {
        let byte = u32::from(byte);
        match i {
            0..=3 => a = a.wrapping_add(byte << (8 * i)),
            4..=7 => b = b.wrapping_add(byte << (8 * (i - 4))),
            _ => c = c.wrapping_add(byte << (8 * (i - 7))),
        }
    }

    finish(&mut a, &mut b, &mut c);
    (u64::from(b) << 32) | u64::from(c)
}

fn word_le(bytes: &[u8]) -> u32 {
    u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]])
}

fn mix(a: &mut u32, b: &mut u32, c: &mut u32) {
    *a = a.wrapping_sub(*c);
    *a ^= c.rotate_left(4);
    *c = c.wrapping_add(*b);
    *b = b.wrapping_sub(*a);
    *b ^= a.rotate_left(6);
    *a = a.wrapping_add(*c);
    *c = c.wrapping_sub(*b);
    *c ^= b.rotate_left(8);
    *b = b.wrapping_add(*a);
    *a = a.wrapping_sub(*c);
    *a ^= c.rotate_left(16);
    *c = c.wrapping_add(*b);
    *b = b.wrapping_sub(*a);
    *b ^= a.rotate_left(19);
    *a = a.wrapping_add(*c);
    *c = c.wrapping_sub(*b);
    *c ^= b.rotate_left(4);
    *b = b.wrapping_add(*a);
}

fn finish(a: &mut u32, b: &mut u32, c: &mut u32) {
    *c ^= *b;
    *c = c.wrapping_sub(b.rotate_left(14));
    *a ^= *c;
    *a = a.wrapping_sub(c.rotate_left(11));
    *b ^= *a;
    *b = b.wrapping_sub(a.rotate_left(25));
    *c ^= *b;
    *c = c.wrapping_sub(b.rotate_left(16));
    *a ^= *c;
    *a = a.wrapping_sub(c.rotate_left(4));
    *b ^= *a;
    *b = b.wrapping_sub(a.rotate_left(14));
    *c ^= *b;
    *c = c.wrapping_sub(b.rotate_left(24));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_a_key_the_way_pg_locks_shows_it() {
        let key = LockKey::from_id(0x0000_0001_0000_0002);
        assert_eq!((key.classid(), key.objid()), (1, 2));

        let negative = LockKey::from_id(-1);
        assert_eq!((negative.classid(), negative.objid()), (u32::MAX, u32::MAX));

        let small = LockKey::from_id(10);
        assert_eq!((small.classid(), small.objid()), (0, 10));
    }

    #[test]
    fn names_hash_to_what_postgresql_computes() {
        // Values printed by `SELECT hashtextextended(name, 0)` on PostgreSQL 15 (x86_64); the
        // integration tests check more names against the running server.
        assert_eq!(LockKey::from_name("").key(), -6_939_563_903_564_495_251);
        assert_eq!(
            LockKey::from_name("nightly").key(),
            2_774_890_235_012_722_556
        );
        assert_eq!(
            LockKey::from_name("hello world!").key(),
            -2_866_487_628_948_787_489
        );
        assert_eq!(
            LockKey::from_name("hello world!!").key(),
            2_407_105_755_976_055_416
        );
    }

    #[test]
    fn displays_the_name_and_the_key() {
        assert_eq!(LockKey::from_id(-7).to_string(), "-7");
        let named = LockKey::from_name("nightly");
        assert_eq!(
            named.to_string(),
            format!("\"nightly\" (key {})", named.key())
        );
    }
}

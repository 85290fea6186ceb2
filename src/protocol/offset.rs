//! Offsets: `<updatedAtMs>_<seq>` (trigger's native format, TOK-01; docs/trigger-dev.md §3
//! "Offsets and handles"). Opaque to the long-poll client, which echoes `electric-offset` back
//! verbatim (docs/protocol.md §4.2).
//!
//! The SSE live mode of `@electric-sql/client` 1.5 builds its next offset itself, as
//! `<global_last_seen_lsn>_0` from the last `up-to-date` control message (`getOffset` in the
//! package's `src/helpers.ts`; docs/protocol.md §13.4). runfeed therefore also accepts that
//! "LSN form": an offset whose second part is `0` is `<lsn>_0` with
//! `lsn = ms × 10⁶ + seq` and `seq < 10⁶` ([`Offset::lsn`], [`Offset::from_lsn`]). Offsets issued
//! to long-poll clients never end in `_0` (their `seq` is a clock-seeded counter ≥ 10¹⁵,
//! `protocol::cursor::next_seq`), so every offset an earlier client generation echoes keeps
//! its meaning.

/// A parsed `offset` request parameter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OffsetParam {
    /// `-1` (or absent): send the snapshot.
    Initial,
    /// `<ms>_<seq>` as issued by this server (or its LSN form `<lsn>_0`).
    At(Offset),
    /// `now`: no history, an immediate `up-to-date` at the current position (Electric's
    /// `offset=now`, `@electric-sql/client` ≥ 1.0.11; <https://electric-sql.com/docs/api/http>).
    Now,
}

/// `10⁶`: an LSN-form offset packs `seq` (< 10⁶) under `ms × 10⁶`.
pub const LSN_SEQ_SPAN: u64 = 1_000_000;

/// An issued offset. `ms` is the newest `updatedAt` (epoch ms) the response covered; `seq`
/// identifies the response (unique per issuing instance).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Offset {
    pub ms: i64,
    pub seq: u64,
}

/// `offset` was not `-1` nor `<int>_<int>` with non-negative parts.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("invalid offset {0:?}: expected -1, now or <ms>_<seq>")]
pub struct InvalidOffset(pub String);

impl OffsetParam {
    /// Parses the request parameter; `None` (absent) means [`OffsetParam::Initial`].
    ///
    /// Accepted: absent or `-1` → [`OffsetParam::Initial`] (also with a handle: that is what
    /// follows a 409, docs/protocol.md §4.2); `<ms>_<seq>` with both parts plain ASCII decimal digits
    /// fitting `i64`/`u64` → [`OffsetParam::At`] (`<lsn>_0` in the LSN form, see the module
    /// docs); `now` → [`OffsetParam::Now`]. Anything else (`5`, `5_`, `-2_0`, `+1_2`, `1_2_3`,
    /// …) → [`InvalidOffset`].
    pub fn parse(raw: Option<&str>) -> Result<OffsetParam, InvalidOffset> {
        match raw {
            None | Some("-1") => Ok(OffsetParam::Initial),
            Some("now") => Ok(OffsetParam::Now),
            Some(s) => Offset::parse_str(s).map(OffsetParam::At),
        }
    }
}

impl Offset {
    /// Parses an issued offset `<ms>_<seq>` (the inverse of `Display`). Both parts must be
    /// non-empty runs of ASCII digits (no sign) that fit `i64` / `u64`. A `seq` of `0` means
    /// the LSN form `<lsn>_0` (lsn fitting `u64`), decoded by [`Offset::from_lsn`].
    pub fn parse_str(s: &str) -> Result<Offset, InvalidOffset> {
        let invalid = || InvalidOffset(s.chars().take(64).collect());
        let (ms, seq) = s.split_once('_').ok_or_else(invalid)?;
        let digits = |p: &str| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit());
        if !digits(ms) || !digits(seq) {
            return Err(invalid());
        }
        let seq = seq.parse::<u64>().map_err(|_| invalid())?;
        if seq == 0 {
            let lsn = ms.parse::<u64>().map_err(|_| invalid())?;
            return Ok(Offset::from_lsn(lsn));
        }
        let ms = ms.parse::<i64>().map_err(|_| invalid())?;
        Ok(Offset { ms, seq })
    }

    /// The LSN this offset is sent as in an SSE `up-to-date` message (`global_last_seen_lsn`):
    /// `ms × 10⁶ + seq`. Only offsets with `0 ≤ ms` and `seq < 10⁶` (those
    /// [`crate::protocol::cursor::next_lsn_seq`] mints) have one; `None` otherwise.
    pub fn lsn(&self) -> Option<u64> {
        let ms = u64::try_from(self.ms).ok()?;
        if self.seq >= LSN_SEQ_SPAN {
            return None;
        }
        ms.checked_mul(LSN_SEQ_SPAN)?.checked_add(self.seq)
    }

    /// The offset an LSN stands for (the inverse of [`Offset::lsn`]).
    pub fn from_lsn(lsn: u64) -> Offset {
        Offset {
            // u64::MAX / 10⁶ fits i64.
            ms: i64::try_from(lsn / LSN_SEQ_SPAN).unwrap_or(i64::MAX),
            seq: lsn % LSN_SEQ_SPAN,
        }
    }
}

impl std::str::FromStr for Offset {
    type Err = InvalidOffset;

    fn from_str(s: &str) -> Result<Offset, InvalidOffset> {
        Offset::parse_str(s)
    }
}

impl Offset {
    /// The two numbers of the text form, formatted into `a` and `b`: `<ms>`, `<seq>`, or the
    /// LSN form `<ms × 10⁶ + seq>`, `0` when `seq == 0` (so that it parses back to itself).
    fn parts<'a>(&self, a: &'a mut itoa::Buffer, b: &'a mut itoa::Buffer) -> (&'a str, &'a str) {
        match (self.seq, self.lsn()) {
            (0, Some(lsn)) => (a.format(lsn), "0"),
            _ => (a.format(self.ms), b.format(self.seq)),
        }
    }

    /// The offset as sent in `electric-offset` (what [`Display`](std::fmt::Display) writes),
    /// built without `fmt` into a string of its exact size: every response writes one.
    pub fn text(&self) -> String {
        let (mut a, mut b) = (itoa::Buffer::new(), itoa::Buffer::new());
        let (first, second) = self.parts(&mut a, &mut b);
        let mut out = String::with_capacity(first.len() + 1 + second.len());
        out.push_str(first);
        out.push('_');
        out.push_str(second);
        out
    }
}

impl std::fmt::Display for Offset {
    /// `<ms>_<seq>`; an offset with `seq == 0` is written in its LSN form `<ms × 10⁶>_0` so that
    /// it parses back to itself.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (mut a, mut b) = (itoa::Buffer::new(), itoa::Buffer::new());
        let (first, second) = self.parts(&mut a, &mut b);
        f.write_str(first)?;
        f.write_str("_")?;
        f.write_str(second)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn tok_01_offset_format() {
        let o = Offset {
            ms: 1_717_667_130_123,
            seq: 7,
        };
        assert_eq!(o.to_string(), "1717667130123_7");
        assert_eq!(Offset { ms: 0, seq: 0 }.to_string(), "0_0");
    }

    #[test]
    fn now_is_its_own_offset() {
        assert_eq!(OffsetParam::parse(Some("now")), Ok(OffsetParam::Now));
    }

    /// What `@electric-sql/client` 1.5 sends after an SSE up-to-date: `<global_last_seen_lsn>_0`.
    #[test]
    fn lsn_form_round_trips_to_the_same_offset() {
        let o = Offset {
            ms: 1_717_667_130_123,
            seq: 42,
        };
        let lsn = o.lsn().expect("small seq has an lsn");
        assert_eq!(lsn, 1_717_667_130_123_000_042);
        assert_eq!(
            OffsetParam::parse(Some(&format!("{lsn}_0"))),
            Ok(OffsetParam::At(o))
        );
        assert_eq!(Offset::from_lsn(lsn), o);
        // long-poll offsets (clock-seeded seq) have no lsn and never end in _0
        let long_poll = Offset {
            ms: 1_717_667_130_123,
            seq: 1_764_000_000_000_000,
        };
        assert_eq!(long_poll.lsn(), None);
        assert!(!long_poll.to_string().ends_with("_0"));
        // seq 0 displays in the lsn form and parses back
        let zero = Offset { ms: 5, seq: 0 };
        assert_eq!(zero.to_string(), "5000000_0");
        assert_eq!(zero.to_string().parse::<Offset>(), Ok(zero));
    }

    #[test]
    fn initial_when_absent_or_minus_one() {
        assert_eq!(OffsetParam::parse(None), Ok(OffsetParam::Initial));
        assert_eq!(OffsetParam::parse(Some("-1")), Ok(OffsetParam::Initial));
    }

    #[test]
    fn parses_issued_offsets() {
        assert_eq!(
            OffsetParam::parse(Some("1717667130123_7")),
            Ok(OffsetParam::At(Offset {
                ms: 1_717_667_130_123,
                seq: 7
            }))
        );
        assert_eq!(
            OffsetParam::parse(Some("0_0")),
            Ok(OffsetParam::At(Offset { ms: 0, seq: 0 }))
        );
        let max = format!("{}_{}", i64::MAX, u64::MAX);
        assert_eq!(
            OffsetParam::parse(Some(&max)),
            Ok(OffsetParam::At(Offset {
                ms: i64::MAX,
                seq: u64::MAX
            }))
        );
    }

    #[test]
    fn rejects_everything_else() {
        let too_big = format!("{}0_0", u64::MAX);
        for bad in [
            "", "abc", "later", "5", "5_", "_5", "-2_0", "0_-1", "1_2_3", "+1_2", "1_+2", " 1_2",
            "1_2 ", "1.5_2", "-1_0", "１_2", &too_big,
        ] {
            assert!(OffsetParam::parse(Some(bad)).is_err(), "{bad:?}");
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        #[test]
        fn offset_round_trips(ms in 0i64.., seq in 1u64..) {
            let o = Offset { ms, seq };
            prop_assert_eq!(OffsetParam::parse(Some(&o.to_string())), Ok(OffsetParam::At(o)));
            prop_assert_eq!(o.text(), format!("{ms}_{seq}"));
        }

        #[test]
        fn lsn_offsets_round_trip(lsn in any::<u64>()) {
            let o = Offset::from_lsn(lsn);
            prop_assert_eq!(o.lsn(), Some(lsn));
            prop_assert_eq!(OffsetParam::parse(Some(&format!("{lsn}_0"))), Ok(OffsetParam::At(o)));
            prop_assert_eq!(OffsetParam::parse(Some(&o.to_string())), Ok(OffsetParam::At(o)));
            let reference = match (o.seq, o.lsn()) {
                (0, Some(lsn)) => format!("{lsn}_0"),
                _ => format!("{}_{}", o.ms, o.seq),
            };
            prop_assert_eq!(o.text(), reference);
        }

        #[test]
        fn offset_parse_never_panics(s in any::<String>()) {
            let _ = OffsetParam::parse(Some(&s));
        }
    }
}

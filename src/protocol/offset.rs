//! Offsets: `<updatedAtMs>_<seq>` (trigger's native format, TOK-01; docs/trigger-dev.md §3
//! "Offsets and handles"). Opaque to the long-poll client, which echoes `electric-offset` back
//! verbatim (docs/protocol.md §4.2).

/// A parsed `offset` request parameter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OffsetParam {
    /// `-1` (or absent): send the snapshot.
    Initial,
    /// `<ms>_<seq>` as issued by this server.
    At(Offset),
}

/// An issued offset. `ms` is the newest `updatedAt` (epoch ms) the response covered; `seq`
/// identifies the response (unique per issuing instance).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Offset {
    pub ms: i64,
    pub seq: u64,
}

/// `offset` was not `-1` nor `<int>_<int>` with non-negative parts.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("invalid offset {0:?}: expected -1 or <ms>_<seq>")]
pub struct InvalidOffset(pub String);

impl OffsetParam {
    /// Parses the request parameter; `None` (absent) means [`OffsetParam::Initial`].
    ///
    /// Accepted: absent or `-1` → [`OffsetParam::Initial`] (also with a handle: that is what
    /// follows a 409, docs/protocol.md §4.2); `<ms>_<seq>` with both parts plain ASCII decimal digits
    /// fitting `i64`/`u64` → [`OffsetParam::At`]. Anything else (`now`, `5`, `5_`, `-2_0`,
    /// `+1_2`, `1_2_3`, …) → [`InvalidOffset`].
    pub fn parse(raw: Option<&str>) -> Result<OffsetParam, InvalidOffset> {
        match raw {
            None | Some("-1") => Ok(OffsetParam::Initial),
            Some(s) => Offset::parse_str(s).map(OffsetParam::At),
        }
    }
}

impl Offset {
    /// Parses an issued offset `<ms>_<seq>` (the inverse of `Display`). Both parts must be
    /// non-empty runs of ASCII digits (no sign) that fit `i64` / `u64`.
    pub fn parse_str(s: &str) -> Result<Offset, InvalidOffset> {
        let invalid = || InvalidOffset(s.chars().take(64).collect());
        let (ms, seq) = s.split_once('_').ok_or_else(invalid)?;
        let digits = |p: &str| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit());
        if !digits(ms) || !digits(seq) {
            return Err(invalid());
        }
        let ms = ms.parse::<i64>().map_err(|_| invalid())?;
        let seq = seq.parse::<u64>().map_err(|_| invalid())?;
        Ok(Offset { ms, seq })
    }
}

impl std::str::FromStr for Offset {
    type Err = InvalidOffset;

    fn from_str(s: &str) -> Result<Offset, InvalidOffset> {
        Offset::parse_str(s)
    }
}

impl std::fmt::Display for Offset {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}_{}", self.ms, self.seq)
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
        let too_big = format!("{}_0", u64::MAX);
        for bad in [
            "", "abc", "now", "5", "5_", "_5", "-2_0", "0_-1", "1_2_3", "+1_2", "1_+2", " 1_2",
            "1_2 ", "1.5_2", "-1_0", "１_2", &too_big,
        ] {
            assert!(OffsetParam::parse(Some(bad)).is_err(), "{bad:?}");
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        #[test]
        fn offset_round_trips(ms in 0i64.., seq in any::<u64>()) {
            let o = Offset { ms, seq };
            prop_assert_eq!(OffsetParam::parse(Some(&o.to_string())), Ok(OffsetParam::At(o)));
        }

        #[test]
        fn offset_parse_never_panics(s in any::<String>()) {
            let _ = OffsetParam::parse(Some(&s));
        }
    }
}

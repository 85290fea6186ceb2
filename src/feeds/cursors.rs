//! The value a fleet-shared replay cursor carries (stored by [`crate::redis::CursorStore`]): the
//! cursor itself and the versions of the runs the latest responses carried, so another instance
//! neither re-reads the whole feed nor re-sends what the client has.

use crate::feeds::diff::Version;
use crate::protocol::RunId;
use crate::router::ReplayCursor;

/// At most this many recent run versions travel with a cursor.
pub const RECENT_MAX: usize = 64;

/// `instance:epoch:seq:wall_ms` (instance in hex), then `;run,ms,hash` per recent run version
/// (runs whose id contains `;` or `,` are left out).
pub fn encode(cursor: &ReplayCursor, recent: &[(RunId, Version)]) -> String {
    let shown = recent.len().min(RECENT_MAX);
    let mut out = String::with_capacity(48 + shown * 48);
    // Written without `fmt` (every recorded state encodes one).
    let mut n = itoa::Buffer::new();
    push_hex(&mut out, cursor.instance);
    out.push(':');
    out.push_str(n.format(cursor.epoch));
    out.push(':');
    out.push_str(n.format(cursor.seq));
    out.push(':');
    out.push_str(n.format(cursor.wall_ms));
    for (id, v) in recent.iter().take(RECENT_MAX) {
        if !id.contains([';', ',']) {
            out.push(';');
            out.push_str(id);
            out.push(',');
            out.push_str(n.format(v.ms));
            out.push(',');
            push_hex(&mut out, v.hash);
        }
    }
    out
}

/// Appends `value` in lowercase hex without leading zeros (`{:x}`).
fn push_hex(out: &mut String, value: u64) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut digits = [0u8; 16];
    let mut at = digits.len();
    let mut rest = value;
    loop {
        at -= 1;
        digits[at] = HEX[(rest & 0xf) as usize];
        rest >>= 4;
        if rest == 0 {
            break;
        }
    }
    out.extend(digits[at..].iter().map(|d| char::from(*d)));
}

pub fn decode(value: &str) -> Option<(ReplayCursor, Vec<(RunId, Version)>)> {
    let mut sections = value.split(';');
    let cursor = decode_cursor(sections.next()?)?;
    let mut recent = Vec::new();
    for entry in sections.take(RECENT_MAX) {
        let mut f = entry.split(',');
        let (Some(id), Some(ms), Some(hash), None) = (f.next(), f.next(), f.next(), f.next())
        else {
            return None;
        };
        let version = Version {
            ms: ms.parse().ok()?,
            hash: u64::from_str_radix(hash, 16).ok()?,
        };
        recent.push((RunId::new(id), version));
    }
    Some((cursor, recent))
}

fn decode_cursor(value: &str) -> Option<ReplayCursor> {
    let mut parts = value.split(':');
    let instance = u64::from_str_radix(parts.next()?, 16).ok()?;
    let epoch = parts.next()?.parse().ok()?;
    let seq = parts.next()?.parse().ok()?;
    let wall_ms = parts.next()?.parse().ok()?;
    if parts.next().is_some() || wall_ms <= 0 {
        return None;
    }
    Some(ReplayCursor {
        epoch,
        seq,
        instance,
        wall_ms,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cur_05_cursor_round_trips_and_garbage_is_unknown() {
        let c = ReplayCursor {
            epoch: 3,
            seq: 42,
            instance: 0xdead_beef,
            wall_ms: 1_700_000_000_000,
        };
        assert_eq!(decode(&encode(&c, &[])), Some((c, vec![])));
        let recent = vec![
            (RunId::from("run1"), Version { ms: 5, hash: 0xabc }),
            (RunId::from("bad;id"), Version { ms: 1, hash: 1 }),
        ];
        assert_eq!(
            decode(&encode(&c, &recent)),
            Some((c, vec![recent[0].clone()]))
        );
        // The text is pinned: other instances and versions read it.
        assert_eq!(
            encode(&c, &recent),
            "deadbeef:3:42:1700000000000;run1,5,abc"
        );
        for n in [0, 1, 0xf, 0x10, 0xdead_beef, u64::MAX] {
            let mut hex = String::new();
            push_hex(&mut hex, n);
            assert_eq!(hex, format!("{n:x}"));
        }
        for bad in [
            "",
            "x",
            "1:2:3",
            "zz:1:2:3",
            "1:2:3:0",
            "1:2:3:4:5",
            "1:-2:3:4",
            "1:2:3:4;r,1",
            "1:2:3:4;r,x,1",
        ] {
            assert_eq!(decode(bad), None, "{bad:?}");
        }
    }
}

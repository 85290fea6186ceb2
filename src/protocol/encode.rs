//! Value encoding: one [`RunRow`] → its `value` object for a column set, serialized once.
//! STUB: signatures fixed; the protocol helper implements them.

use super::{ColumnSet, RunRow, SerializedRow};

/// Serializes `row` for `cols` into a [`SerializedRow`] (fragment, hash, dequeued flag).
/// Encoding rules: protocol.md §3.6–3.7, trigger-facts §1.4 (timestamps `YYYY-MM-DDTHH:MM:SS.mmm`
/// without zone, bool `t`/`f`, int4 decimal, float8 as JS `String(number)`, `text[]` as a quoted
/// array literal with `runTags` empty → null and `realtimeStreams` empty/null → `{}`, jsonb as
/// compact JSON, nulls as JSON null).
pub fn serialize_row(row: &RunRow, cols: ColumnSet) -> SerializedRow {
    let _ = (row, cols);
    unimplemented!("protocol helper")
}

/// The `electric-schema` header value for `cols`: `{"id":{"type":"text"},…,"runTags":{"type":"text","dims":1},…}`.
pub fn schema_header(cols: ColumnSet) -> String {
    let _ = cols;
    unimplemented!("protocol helper")
}

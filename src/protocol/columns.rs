//! The 26 `"TaskRun"` columns of trigger.dev's realtime feed, in wire order
//! (`RUN_ELECTRIC_COLUMNS`, `electricStreamProtocol.server.ts` L27-54; docs/trigger-dev.md §1.4).

/// One projected column. The discriminant is the wire position (0..26).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u8)]
pub enum Column {
    Id,
    TaskIdentifier,
    CreatedAt,
    UpdatedAt,
    StartedAt,
    DelayUntil,
    QueuedAt,
    ExpiredAt,
    CompletedAt,
    FriendlyId,
    Number,
    IsTest,
    Status,
    UsageDurationMs,
    CostInCents,
    BaseCostInCents,
    Ttl,
    Payload,
    PayloadType,
    Metadata,
    MetadataType,
    Output,
    OutputType,
    RunTags,
    Error,
    RealtimeStreams,
}

impl Column {
    /// Every column in wire order.
    pub const ALL: [Column; 26] = [
        Column::Id,
        Column::TaskIdentifier,
        Column::CreatedAt,
        Column::UpdatedAt,
        Column::StartedAt,
        Column::DelayUntil,
        Column::QueuedAt,
        Column::ExpiredAt,
        Column::CompletedAt,
        Column::FriendlyId,
        Column::Number,
        Column::IsTest,
        Column::Status,
        Column::UsageDurationMs,
        Column::CostInCents,
        Column::BaseCostInCents,
        Column::Ttl,
        Column::Payload,
        Column::PayloadType,
        Column::Metadata,
        Column::MetadataType,
        Column::Output,
        Column::OutputType,
        Column::RunTags,
        Column::Error,
        Column::RealtimeStreams,
    ];

    /// The column's name, as in Postgres (quoted camelCase) and on the wire.
    pub fn name(self) -> &'static str {
        match self {
            Column::Id => "id",
            Column::TaskIdentifier => "taskIdentifier",
            Column::CreatedAt => "createdAt",
            Column::UpdatedAt => "updatedAt",
            Column::StartedAt => "startedAt",
            Column::DelayUntil => "delayUntil",
            Column::QueuedAt => "queuedAt",
            Column::ExpiredAt => "expiredAt",
            Column::CompletedAt => "completedAt",
            Column::FriendlyId => "friendlyId",
            Column::Number => "number",
            Column::IsTest => "isTest",
            Column::Status => "status",
            Column::UsageDurationMs => "usageDurationMs",
            Column::CostInCents => "costInCents",
            Column::BaseCostInCents => "baseCostInCents",
            Column::Ttl => "ttl",
            Column::Payload => "payload",
            Column::PayloadType => "payloadType",
            Column::Metadata => "metadata",
            Column::MetadataType => "metadataType",
            Column::Output => "output",
            Column::OutputType => "outputType",
            Column::RunTags => "runTags",
            Column::Error => "error",
            Column::RealtimeStreams => "realtimeStreams",
        }
    }

    /// Looks a column up by its exact (case-sensitive) name.
    pub fn from_name(name: &str) -> Option<Column> {
        Column::ALL.iter().copied().find(|c| c.name() == name)
    }

    /// Columns that `skipColumns` can never remove (trigger's `RESERVED_COLUMNS`).
    pub fn is_reserved(self) -> bool {
        matches!(
            self,
            Column::Id
                | Column::TaskIdentifier
                | Column::FriendlyId
                | Column::Status
                | Column::CreatedAt
        )
    }

    /// The `type` in `electric-schema` (docs/protocol.md §3.6/§3.7).
    pub fn electric_type(self) -> &'static str {
        match self {
            Column::CreatedAt
            | Column::UpdatedAt
            | Column::StartedAt
            | Column::DelayUntil
            | Column::QueuedAt
            | Column::ExpiredAt
            | Column::CompletedAt => "timestamp",
            Column::Number | Column::UsageDurationMs => "int4",
            Column::IsTest => "bool",
            Column::CostInCents | Column::BaseCostInCents => "float8",
            Column::Error => "jsonb",
            _ => "text",
        }
    }

    /// `dims` in `electric-schema`: 1 for the two `text[]` columns.
    pub fn dims(self) -> Option<u8> {
        matches!(self, Column::RunTags | Column::RealtimeStreams).then_some(1)
    }

    fn bit(self) -> u32 {
        1 << (self as u8)
    }
}

/// The set of columns one feed emits (all 26 minus its `skipColumns`). Feeds with the same set
/// share hydrates and serialized rows (reference `columnSig`).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, PartialOrd, Ord)]
pub struct ColumnSet(u32);

impl ColumnSet {
    /// All 26 columns.
    pub const ALL: ColumnSet = ColumnSet((1 << 26) - 1);

    /// Every column except those named in `skip`. Entries are trimmed; empty, unknown and
    /// reserved names are ignored (docs/trigger-dev.md §3 `skipColumns`, behaviour REQ-01).
    pub fn from_skip_list<S: AsRef<str>>(skip: impl IntoIterator<Item = S>) -> ColumnSet {
        let mut bits = Self::ALL.0;
        for name in skip {
            if let Some(col) = Column::from_name(name.as_ref().trim()) {
                if !col.is_reserved() {
                    bits &= !col.bit();
                }
            }
        }
        ColumnSet(bits)
    }

    /// Whether `col` is emitted.
    pub fn contains(self, col: Column) -> bool {
        self.0 & col.bit() != 0
    }

    /// The emitted columns in wire order.
    pub fn columns(self) -> impl Iterator<Item = Column> {
        Column::ALL.into_iter().filter(move |c| self.contains(*c))
    }

    /// Names of the skipped columns, in wire order (stable, used in cache keys and handles).
    pub fn skipped(self) -> Vec<&'static str> {
        Column::ALL
            .into_iter()
            .filter(|c| !self.contains(*c))
            .map(Column::name)
            .collect()
    }

    /// Compact stable id of the set (a bitmask), for cache keys and handle binding.
    pub fn bits(self) -> u32 {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ser_08_skip_list_ignores_reserved_unknown_and_blank() {
        let set = ColumnSet::from_skip_list([" payload", "output ", "id", "nope", "", "createdAt"]);
        assert!(!set.contains(Column::Payload));
        assert!(!set.contains(Column::Output));
        assert!(set.contains(Column::Id));
        assert!(set.contains(Column::CreatedAt));
        assert_eq!(set.skipped(), vec!["payload", "output"]);
        assert_eq!(set.columns().count(), 24);
    }

    #[test]
    fn ser_01_twenty_six_columns_in_wire_order() {
        let names: Vec<_> = ColumnSet::ALL.columns().map(Column::name).collect();
        assert_eq!(names.len(), 26);
        assert_eq!(names[0], "id");
        assert_eq!(names[25], "realtimeStreams");
        for c in Column::ALL {
            assert_eq!(Column::from_name(c.name()), Some(c));
        }
    }
}

//! Postgres encoding of the id types ([`crate::protocol::ids`]): each binds and decodes as
//! `text` (arrays as `text[]`), so queries take and return ids as their own types.

use sqlx::encode::IsNull;
use sqlx::error::BoxDynError;
use sqlx::postgres::{PgArgumentBuffer, PgHasArrayType, PgTypeInfo, PgValueRef};
use sqlx::{Decode, Encode, Postgres, Type};

use crate::protocol::{BatchId, EnvId, FriendlyBatchId, FriendlyRunId, OrgId, RunId};

macro_rules! pg_text_id {
    ($($name:ident),*) => {$(
        impl Type<Postgres> for $name {
            fn type_info() -> PgTypeInfo {
                <&str as Type<Postgres>>::type_info()
            }
            fn compatible(ty: &PgTypeInfo) -> bool {
                <&str as Type<Postgres>>::compatible(ty)
            }
        }

        impl PgHasArrayType for $name {
            fn array_type_info() -> PgTypeInfo {
                <&str as PgHasArrayType>::array_type_info()
            }
        }

        impl Encode<'_, Postgres> for $name {
            fn encode_by_ref(&self, buf: &mut PgArgumentBuffer) -> Result<IsNull, BoxDynError> {
                <&str as Encode<Postgres>>::encode(self.as_str(), buf)
            }
        }

        impl<'r> Decode<'r, Postgres> for $name {
            fn decode(value: PgValueRef<'r>) -> Result<Self, BoxDynError> {
                Ok($name::new(<&str as Decode<Postgres>>::decode(value)?))
            }
        }
    )*};
}

pg_text_id!(EnvId, OrgId, RunId, FriendlyRunId, BatchId, FriendlyBatchId);

//! Logging (tracing), metrics (OpenTelemetry) and the admin listener.
//!
//! - [`init_logging`] / [`init_logging_with`]: the global `tracing` subscriber (pretty or JSON).
//! - [`metrics`]: every instrument, named `runfeed.<area>.<name>`, in one struct.
//! - [`Telemetry`]: one OpenTelemetry meter provider per server, read by a Prometheus registry
//!   (scraped at the admin listener's `/metrics`) and, when `telemetry.otlp_endpoint` is set,
//!   pushed over OTLP/HTTP every `otlp_interval_ms`.
//! - [`admin`]: `/metrics`, `/healthz`, `/readyz` on their own port.
//! - [`http`]: the request span and the HTTP metrics middleware.

pub mod admin;
pub mod http;
pub mod metrics;

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use opentelemetry::metrics::MeterProvider;
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::metrics::{PeriodicReader, SdkMeterProvider};
use opentelemetry_sdk::Resource;
use tracing_subscriber::EnvFilter;

use crate::config::TelemetryConfig;
pub use metrics::{Liveness, Metrics};

/// Installs the global subscriber: `RUST_LOG` filter (default `info`, sqlx notices muted), JSON lines when
/// `RUNFEED_LOG_FORMAT=json`, pretty otherwise. Logs go to stderr. Safe to call twice.
pub fn init_logging() {
    init_logging_with("pretty");
}

/// [`init_logging`] with the configured `telemetry.log_format` (`"json"` or `"pretty"`);
/// `RUNFEED_LOG_FORMAT=json` selects JSON either way. Only the first call in a process takes
/// effect.
///
/// Nothing logs request headers (the request span carries method, route, path, env id and
/// status), so bearer tokens never reach the logs.
pub fn init_logging_with(format: &str) {
    let filter = EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| EnvFilter::new("info,sqlx::postgres::notice=warn"));
    let json = format == "json" || std::env::var("RUNFEED_LOG_FORMAT").is_ok_and(|v| v == "json");
    // No ANSI colours when stderr is not a terminal (files, containers, test harnesses).
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr())
        && std::env::var_os("NO_COLOR").is_none();
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(ansi);
    let _ = if json {
        builder
            .json()
            .with_current_span(true)
            .with_span_list(false)
            .try_init()
    } else {
        builder.try_init()
    };
}

/// The metrics pipeline of one server: meter provider, Prometheus registry, instruments.
pub struct Telemetry {
    provider: SdkMeterProvider,
    registry: prometheus::Registry,
    metrics: Arc<Metrics>,
    otlp: bool,
}

impl std::fmt::Debug for Telemetry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Telemetry")
            .field("otlp", &self.otlp)
            .finish_non_exhaustive()
    }
}

impl Telemetry {
    /// Builds the provider: a Prometheus reader always (its registry is what `/metrics`
    /// serves), an OTLP/HTTP periodic exporter when `cfg.otlp_endpoint` is set.
    ///
    /// Errors: the Prometheus exporter or the OTLP exporter cannot be built (e.g. an invalid
    /// endpoint URL).
    pub fn new(cfg: &TelemetryConfig) -> anyhow::Result<Telemetry> {
        let registry = prometheus::Registry::new();
        let exporter = opentelemetry_prometheus::exporter()
            .with_registry(registry.clone())
            .build()
            .context("building the Prometheus exporter")?;
        let resource = Resource::builder().with_service_name("runfeed").build();
        let mut builder = SdkMeterProvider::builder()
            .with_resource(resource)
            .with_reader(exporter);
        let endpoint = cfg
            .otlp_endpoint
            .as_deref()
            .map(str::trim)
            .filter(|e| !e.is_empty());
        if let Some(endpoint) = endpoint {
            let url = otlp_metrics_url(endpoint);
            let exporter = opentelemetry_otlp::MetricExporter::builder()
                .with_http()
                .with_endpoint(url.clone())
                .with_timeout(Duration::from_secs(10))
                .build()
                .with_context(|| format!("building the OTLP metrics exporter for {url}"))?;
            let reader = PeriodicReader::builder(exporter)
                .with_interval(Duration::from_millis(cfg.otlp_interval_ms.max(1)))
                .build();
            builder = builder.with_reader(reader);
            tracing::info!(endpoint = %url, interval_ms = cfg.otlp_interval_ms, "exporting metrics over OTLP/HTTP");
        }
        let provider = builder.build();
        let metrics = Arc::new(Metrics::new(&provider.meter(metrics::METER_NAME)));
        Ok(Telemetry {
            provider,
            registry,
            metrics,
            otlp: endpoint.is_some(),
        })
    }

    /// The instruments.
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// The Prometheus registry `/metrics` encodes.
    pub fn registry(&self) -> &prometheus::Registry {
        &self.registry
    }

    /// Flushes (OTLP: a final export) and stops the readers. Blocking: the OTLP export runs on
    /// the SDK's own thread, so this runs on a blocking-pool thread.
    pub async fn shutdown(self) {
        let provider = self.provider;
        let otlp = self.otlp;
        let _ = tokio::task::spawn_blocking(move || {
            if let Err(err) = provider.shutdown() {
                if otlp {
                    tracing::warn!(error = %err, "metrics shutdown");
                }
            }
        })
        .await;
    }
}

/// The OTLP/HTTP metrics URL for a configured endpoint: used as is when it has a path, with
/// `/v1/metrics` appended to a bare `scheme://host:port` (the collector's base address).
fn otlp_metrics_url(endpoint: &str) -> String {
    let after_scheme = endpoint
        .split_once("://")
        .map_or(endpoint, |(_, rest)| rest);
    match after_scheme.find('/') {
        Some(i) if after_scheme.len() > i + 1 => endpoint.to_string(),
        _ => format!("{}/v1/metrics", endpoint.trim_end_matches('/')),
    }
}

/// Renders a Prometheus registry in the text exposition format.
pub fn encode_prometheus(registry: &prometheus::Registry) -> Result<String, prometheus::Error> {
    use prometheus::Encoder;
    let mut buf = Vec::new();
    prometheus::TextEncoder::new().encode(&registry.gather(), &mut buf)?;
    Ok(String::from_utf8_lossy(&buf).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn otlp_url_gets_the_metrics_path_only_when_bare() {
        assert_eq!(
            otlp_metrics_url("http://c:4318"),
            "http://c:4318/v1/metrics"
        );
        assert_eq!(
            otlp_metrics_url("http://c:4318/"),
            "http://c:4318/v1/metrics"
        );
        assert_eq!(
            otlp_metrics_url("http://c:4318/v1/metrics"),
            "http://c:4318/v1/metrics"
        );
        assert_eq!(
            otlp_metrics_url("https://c/otlp/v1/metrics"),
            "https://c/otlp/v1/metrics"
        );
    }

    #[test]
    fn prometheus_names_follow_the_documented_rule() {
        let t = Telemetry::new(&TelemetryConfig::default()).expect("telemetry");
        let m = t.metrics();
        m.emitted(
            metrics::DeliveryPath::Notify,
            2,
            Some(crate::clock::now_ms()),
        );
        m.http_bytes("/x", 10);
        let text = encode_prometheus(t.registry()).expect("encode");
        for name in [
            "runfeed_feeds_delivery_lag_milliseconds_bucket",
            "runfeed_feeds_emitted_rows_bucket",
            "runfeed_feeds_wakeups_total{",
            "runfeed_http_sent_bytes_total{",
        ] {
            assert!(text.contains(name), "{name} missing in\n{text}");
        }
    }

    /// The count of the series of `family` whose labels include every one of `labels`.
    fn count_of(text: &str, family: &str, labels: &[&str]) -> Option<f64> {
        text.lines()
            .filter(|l| l.starts_with(&format!("{family}{{")))
            .find(|l| labels.iter().all(|label| l.contains(label)))
            .and_then(|l| l.rsplit(' ').next()?.parse().ok())
    }

    #[test]
    fn a_bound_histogram_exports_each_label_set_with_every_record() {
        use std::time::Duration;
        let t = Telemetry::new(&TelemetryConfig::default()).expect("telemetry");
        let m = t.metrics();
        let route = "/realtime/v1/runs/{run_id}";
        for live in [
            metrics::Liveness::Live,
            metrics::Liveness::Live,
            metrics::Liveness::NotLive,
        ] {
            m.http_request(route, "GET", 200, live, Duration::from_millis(3));
        }
        m.http_request(
            route,
            "GET",
            404,
            metrics::Liveness::NotLive,
            Duration::ZERO,
        );
        m.emitted(metrics::DeliveryPath::Notify, 2, None);
        m.emitted(metrics::DeliveryPath::Notify, 3, None);
        m.emitted(metrics::DeliveryPath::Replay, 1, None);
        let text = encode_prometheus(t.registry()).expect("encode");
        let family = "runfeed_http_duration_milliseconds_count";
        let route_label = format!("route=\"{route}\"");
        let count = |labels: &[&str]| count_of(&text, family, labels);
        assert_eq!(
            count(&[&route_label, "live=\"true\"", "status=\"200\""]),
            Some(2.0),
            "{text}"
        );
        assert_eq!(
            count(&[&route_label, "live=\"false\"", "status=\"200\""]),
            Some(1.0)
        );
        assert_eq!(
            count(&[&route_label, "live=\"false\"", "status=\"404\""]),
            Some(1.0)
        );
        assert_eq!(count(&["status=\"404\"", "live=\"true\""]), None);
        let rows = |path: &str| {
            let label = format!("path=\"{path}\"");
            count_of(&text, "runfeed_feeds_emitted_rows_sum", &[&label])
        };
        assert_eq!(rows("notify"), Some(5.0));
        assert_eq!(rows("replay"), Some(1.0));
        assert_eq!(rows("cold"), None, "a label set appears once recorded");
    }
}

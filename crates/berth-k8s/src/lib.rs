//! berth's Kubernetes runtime: each user's instance is a Pod, with a
//! headless Service (its endpoint), a ConfigMap (its patch), a
//! NetworkPolicy (ingress only from berth; no egress to private ranges or
//! metadata services unless configured) and storage (a claim per user, or
//! a `subPath` of one shared claim).
//!
//! [`K8sRuntime`] implements [`berth_core::runtime::Runtime`], so the
//! controller's lease, crash policy, breaker and reaper apply unchanged. It
//! talks to the API server with `kube` and the typed objects of
//! `k8s-openapi`, compiled for **Kubernetes API 1.33** (k8s-openapi's
//! feature `v1_33`); every generated manifest is validated against the
//! official schemas of 1.33 and 1.37, the range berth supports.
//!
//! * [`config`]: the `[kubernetes]` table, validated key by key;
//! * [`names`]: object names (`berth-<slug>`), labels and annotations;
//! * [`manifest`]: the objects, as pure functions of config and plain data;
//! * [`observe`]: what a pod's status means for a run (ready, exited, …),
//!   as a pure state machine;
//! * [`K8sRuntime`]: the I/O — create-or-replace, one watch over every
//!   berth pod, logs, adoption;
//! * `testing` (feature `test-double`): a **double** of the Kubernetes API
//!   server for tests, with a stand-in kubelet that runs each pod's command
//!   as a local process.
//!
//! # Crashes
//!
//! Pods run with `restartPolicy: Never`: a container that ends ends its
//! pod, and the runtime reports the exit. berth's crash policy and breaker
//! then decide, exactly as for local instances — backoff, the breaker's
//! window and cooldown, `no_restart_exit_codes`, the watchdog — instead of
//! the kubelet's CrashLoopBackOff, which knows none of these, would hide
//! exits from the breaker, and would restart a program the breaker has
//! given up on. A restart the kubelet makes anyway (an admission webhook
//! that changes the policy) is reported as the exit it was, and that pod is
//! deleted, so the controller's decision is the only one.
//!
//! # Freeze and a fence deadline: berth's shim in the pod
//!
//! Kubernetes cannot pause a container or stop it on a deadline of its
//! own. With `[kubernetes.shim]`, berth's own shim is each main pod's
//! entrypoint and does both (`runtime/shim.rs` is berth's side of it), and
//! [`K8sRuntime::capabilities`] declares freeze, a fence deadline and
//! command hooks; without it, none. Either way one instance per user
//! rests on the API server's one object per name (see `docs/design.md`,
//! "berth's shim in the pod" and "How fencing maps onto Kubernetes").

#![forbid(unsafe_code)]

pub mod config;
pub mod manifest;
pub mod names;
pub mod observe;
mod runtime;
#[cfg(feature = "test-double")]
pub mod testing;

pub use config::{ConfigError, EndpointMode, K8sRuntimeConfig, KubernetesConfig};
pub use runtime::{EndpointResolver, K8sRuntime, ServiceDns, connect};

//! A followed run: the views the watch sends it become events through its
//! [`Tracker`].

use std::sync::Arc;

use berth_core::runtime::{EVENT_BUFFER, RuntimeEvent};
use tokio::sync::{mpsc, watch};

use berth_core::Role;

use super::shim::ShimLink;
use super::{Inner, RunHandle, lock};
use crate::observe::{PodView, Step, Tracker};

impl Inner {
    /// Follows the pod `name` (`uid`) as a run under `epoch`; a main pod
    /// with berth's shim also through its link to the shim.
    pub(super) fn follow(
        self: &Arc<Self>,
        name: &str,
        uid: &str,
        tracker: Tracker,
        role: Role,
    ) -> mpsc::Receiver<RuntimeEvent> {
        let (events, receiver) = mpsc::channel(EVENT_BUFFER);
        let link =
            (role == Role::Main && self.config.kubernetes.shim.is_some()).then(ShimLink::new);
        let views = {
            let mut state = lock(&self.state);
            let mut view = state.pods.get(name).map(PodView::of).unwrap_or_default();
            if view.uid != uid {
                // Not in the cache (yet): its first view is on its way.
                view = PodView {
                    name: name.to_owned(),
                    uid: uid.to_owned(),
                    ..PodView::default()
                };
            }
            let (sender, views) = watch::channel(view);
            state.runs.insert(
                name.to_owned(),
                RunHandle {
                    uid: uid.to_owned(),
                    views: sender,
                    shim: link.clone(),
                },
            );
            views
        };
        let inner = self.clone();
        let (name, uid) = (name.to_owned(), uid.to_owned());
        // The link ends with the run.
        let link_cancel = self.cancel.child_token();
        if let Some(link) = link {
            let task = Arc::clone(self).keep_shim_link(
                (name.clone(), uid.clone()),
                link,
                views.clone(),
                events.clone(),
                link_cancel.clone(),
            );
            self.tasks.spawn(task);
        }
        self.tasks.spawn(async move {
            let _end_link = link_cancel.drop_guard();
            inner.run(&name, &uid, tracker, views, events).await;
            let mut state = lock(&inner.state);
            if state.runs.get(&name).is_some_and(|r| r.uid == uid) {
                state.runs.remove(&name);
            }
        });
        receiver
    }

    async fn run(
        self: &Arc<Self>,
        name: &str,
        uid: &str,
        mut tracker: Tracker,
        mut views: watch::Receiver<PodView>,
        events: mpsc::Sender<RuntimeEvent>,
    ) {
        let scan_cancel = self.cancel.child_token();
        let _stop_scan = scan_cancel.clone().drop_guard();
        let (tokens, mut found) = mpsc::channel::<Option<String>>(1);
        loop {
            let view = views.borrow_and_update().clone();
            for step in tracker.observe(&view) {
                match step {
                    Step::Emit(event) => {
                        if events.send(event).await.is_err() {
                            return;
                        }
                    }
                    Step::ScanLog => {
                        self.scan_for_token(name, tokens.clone(), scan_cancel.clone());
                    }
                    Step::Finish { exit, delete } => {
                        if delete {
                            let _ = self.delete_pod(name, uid, 1).await;
                        }
                        self.keep_log(name).await;
                        let _ = events.send(RuntimeEvent::Exited(exit)).await;
                        return;
                    }
                }
            }
            tokio::select! {
                _ = self.cancel.cancelled() => return,
                _ = events.closed() => return,
                changed = views.changed() => if changed.is_err() { return },
                Some(token) = found.recv() => {
                    let view = views.borrow().clone();
                    for step in tracker.ready_line_found(token, &view) {
                        if let Step::Emit(event) = step
                            && events.send(event).await.is_err()
                        {
                            return;
                        }
                    }
                }
            }
        }
    }
}

// kube-scheduler with one extra Permit plugin, HoldForTest, for the tests of the binding race: a pod that
// carries the label dynamig.io/test-hold-seconds waits that many seconds in Permit, after its scheduling
// cycle allocated its claims (in memory) and before the DRA plugin's PreBind writes the allocation, as a
// coscheduling or quota plugin holds pods in production. Everything else is the stock kube-scheduler of the
// pinned Kubernetes module. Enable it in a profile: plugins.permit.enabled: [{name: HoldForTest}].
package main

import (
	"context"
	"os"
	"strconv"
	"time"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/component-base/cli"
	fwk "k8s.io/kube-scheduler/framework"
	"k8s.io/kubernetes/cmd/kube-scheduler/app"
)

const (
	name      = "HoldForTest"
	holdLabel = "dynamig.io/test-hold-seconds"
)

type hold struct{ handle fwk.Handle }

func (h *hold) Name() string { return name }

// Permit asks the framework to wait, and lets the pod go after the label's seconds. A pod without the
// label is not held.
func (h *hold) Permit(_ context.Context, _ fwk.CycleState, pod *v1.Pod, _ string) (*fwk.Status, time.Duration) {
	seconds, err := strconv.ParseFloat(pod.Labels[holdLabel], 64)
	if err != nil || seconds <= 0 {
		return nil, 0
	}
	held := time.Duration(seconds * float64(time.Second))
	uid := pod.UID
	go func() {
		time.Sleep(held)
		if waiting := h.handle.GetWaitingPod(uid); waiting != nil {
			waiting.Allow(name)
		}
	}()
	return fwk.NewStatus(fwk.Wait, "held for the binding-race test"), held + time.Minute
}

func newHold(_ context.Context, _ runtime.Object, handle fwk.Handle) (fwk.Plugin, error) {
	return &hold{handle: handle}, nil
}

func main() {
	command := app.NewSchedulerCommand(app.WithPlugin(name, newHold))
	os.Exit(cli.Run(command))
}

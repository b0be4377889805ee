"""What the lag proxy (devcluster/lagproxy.py) reads off a request: its resource, whether it is a watch,
whether it writes a pod's nomination. Pure functions."""

from dynamig.devcluster.lagproxy import is_watch, resource_of, sets_nomination

STATUS = "/api/v1/namespaces/ns/pods/p/status"


def test_request_paths_name_their_resource_and_watches() -> None:
    assert resource_of("/api/v1/namespaces/ns/pods/p/status") == "pods"
    assert resource_of("/api/v1/pods") == "pods"
    assert resource_of("/apis/resource.k8s.io/v1/resourceslices") == "resourceslices"
    assert resource_of("/apis/resource.k8s.io/v1/namespaces/ns/resourceclaims/c") == "resourceclaims"
    assert resource_of("/healthz") == ""
    assert is_watch("allowWatchBookmarks=true&watch=true") and is_watch("watch=1")
    assert not is_watch("watch=false") and not is_watch("limit=500")
    patch = b'{"status":{"nominatedNodeName":"n1"}}'
    assert sets_nomination("PATCH", STATUS, patch)
    assert not sets_nomination("PATCH", STATUS, b'{"status":{"nominatedNodeName":null}}')  # a clear
    assert not sets_nomination("PATCH", "/api/v1/namespaces/ns/pods/p", patch)
    assert not sets_nomination("GET", "/api/v1/namespaces/ns/pods/p/status", patch)

// The oracle of tests/test_ready_queue.py: PyTorch's ready queue, a
// std::priority_queue with CompareNodeTaskTime (engine.cpp), run by the
// standard library this program is built with. See Note [Ties in the ready
// queue] in pyengine/_pure/ready_queue.py.
//
// Each input line is one case, a sequence of operations:
//   push ID GROUP SHUTDOWN HAS_NODE DEPTH SEQUENCE_NR
//   pop
//   discard GROUP   (pyengine's ReadyQueue.discard_graph_task: keep the other
//                    tasks in heap order, then std::make_heap)
// and gives one output line: the IDs in the order they popped. The first
// output line says which standard library ran: "libstdc++" or "other".
#include <algorithm>
#include <cstdint>
#include <iostream>
#include <queue>
#include <sstream>
#include <string>
#include <vector>

struct NodeTask {
    long id;
    int group;  // the graph task
    bool is_shutdown;
    bool has_node;
    int reentrant_depth;
    uint64_t sequence_nr;
};

// PyTorch's comparator, verbatim but for the field names.
struct CompareNodeTaskTime {
    bool operator()(const NodeTask &t1, const NodeTask &t2) const {
        if (t2.is_shutdown) {
            return true;
        } else if (!t1.has_node || t1.is_shutdown) {
            return false;
        } else if (!t2.has_node) {
            return true;
        } else if (t1.reentrant_depth == t2.reentrant_depth) {
            return t1.sequence_nr < t2.sequence_nr;
        } else {
            return t1.reentrant_depth < t2.reentrant_depth;
        }
    }
};

struct ReadyQueue : std::priority_queue<NodeTask, std::vector<NodeTask>, CompareNodeTaskTime> {
    void discard_graph_task(int group) {
        std::vector<NodeTask> kept;
        for (const NodeTask &task : c) {
            if (task.group != group) {
                kept.push_back(task);
            }
        }
        c.swap(kept);
        std::make_heap(c.begin(), c.end(), comp);
    }
};

int main() {
#ifdef __GLIBCXX__
    std::cout << "libstdc++\n";
#else
    std::cout << "other\n";
#endif
    std::string line;
    while (std::getline(std::cin, line)) {
        std::istringstream operations(line);
        ReadyQueue queue;
        std::string operation;
        while (operations >> operation) {
            if (operation == "push") {
                NodeTask task;
                operations >> task.id >> task.group >> task.is_shutdown >> task.has_node >>
                    task.reentrant_depth >> task.sequence_nr;
                queue.push(task);
            } else if (operation == "pop") {
                std::cout << queue.top().id << ' ';
                queue.pop();
            } else if (operation == "discard") {
                int group;
                operations >> group;
                queue.discard_graph_task(group);
            }
        }
        std::cout << '\n';
    }
    return 0;
}
